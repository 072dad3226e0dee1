"""Small things a new user meets first: help() shows the keyword arguments, ``info`` lists
every documented variable and never cuts a reason, the plugin README's claims hold, the LSTM
demo's loss change reads sensibly."""

import pathlib
import re

import numpy as np
import pytest

import numbaconv as nc
from numbaconv import cli, config
from numbaconv.backend import Backend
from numbaconv.__main__ import main

ROOT = pathlib.Path(__file__).resolve().parents[1]

PUBLIC = (nc.conv, nc.conv_backward_data, nc.conv_backward_weight, nc.conv_backward,
          nc.conv_transpose, nc.conv_transpose_backward, nc.conv_output_shape)


@pytest.mark.parametrize("func", PUBLIC, ids=lambda f: f.__name__)
def test_help_documents_the_keywords_itself(func):
    doc = func.__doc__
    assert "module docstring" not in doc and "{keywords}" not in doc
    for entry in ("stride : int or tuple of int", "dilation : int or tuple of int",
                  "groups : int, default 1", 'layout : {"channels_first", "channels_last"}'):
        assert entry in doc
    assert "padding" in doc


def test_keyword_docs_are_written_once():
    source = (ROOT / "numbaconv" / "conv.py").read_text()
    assert source.count("Spacing between kernel taps") == 1
    assert "{keywords}" not in nc.conv_backward_bias.__doc__
    assert "layout : " in nc.conv_backward_bias.__doc__


def test_config_table_lists_the_variables():
    names = config.documented_variables()
    for name in ("NUMBACONV_BACKEND", "NUMBACONV_AUTOTUNE", "NUMBACONV_CACHE_DIR",
                 "NUMBACONV_JIT_CACHE", "NUMBACONV_WINOGRAD", "NUMBACONV_FASTMATH",
                 "NUMBACONV_OMP_PASSIVE", "NUMBACONV_CUDA_GEMM_TILE"):
        assert name in names
    assert len(set(names)) == len(names)


def test_every_variable_read_is_documented():
    read = set()
    for path in (ROOT / "numbaconv").rglob("*.py"):
        read |= set(re.findall(r"""["'](NUMBACONV_[A-Z0-9_]+)["']""", path.read_text()))
    assert read <= set(config.documented_variables())


def test_readme_configuration_table_matches_config():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Configuration"):]
    section = section[:section.index("\n## ", 5)]
    in_table = re.findall(r"`(NUMBACONV_\w+)`", "\n".join(
        line.split("|")[1] for line in section.splitlines() if line.startswith("| `")))
    assert set(in_table) == set(config.documented_variables())


def test_info_lists_every_documented_variable_and_the_kernel_cache(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in config.documented_variables() + ("NUMBA_CACHE_DIR",):
        assert re.search(rf"^  {name} +", out, re.M), name
    assert "kernel cache" in out


class LongReason(Backend):
    name = "long_reason"
    device = "cpu"
    priority = -100
    ops = frozenset({"conv"})
    REASON = ("this backend needs a library that is not installed here: install "
              "it with pip install some-long-package-name[extra] and set "
              "SOME_VARIABLE=1 before importing numbaconv, then run numbaconv info again "
              "to see it available; supercalifragilisticexpialidocious ends the reason")

    def availability(self):
        return self.REASON

    def run(self, op, problem, operands, out, algorithm):
        raise AssertionError("unavailable")


def test_info_wraps_long_reasons_at_words(capsys):
    nc.register_backend(LongReason.name, LongReason)
    try:
        assert main(["info"]) == 0
    finally:
        nc.unregister_backend(LongReason.name)
    out = capsys.readouterr().out
    words = out[out.index("long_reason"):].split()
    text = " ".join(words)
    assert " ".join(LongReason.REASON.split()) in text     # every word, whole, in order
    assert "..." not in out[out.index("backends"):]


def test_one_line_cuts_at_a_word_boundary():
    text = "alpha beta gamma delta epsilon zeta eta theta"
    cut = cli._one_line(text, 24)
    assert cut.endswith("...") and len(cut) <= 24
    assert cut[:-3].split()[-1] in text.split()             # no word cut in half


def test_plugin_readme_snippet_tells_the_truth():
    pytest.importorskip("numbaconv_torch")
    readme = (ROOT / "plugins" / "numbaconv-torch" / "README.md").read_text()
    use = readme[readme.index("## Use"):]
    assert "'cpu'" in use
    x = np.random.rand(2, 3, 8, 8).astype(np.float32)
    w = np.random.rand(4, 3, 3, 3).astype(np.float32)
    assert nc.explain("conv", x, w, padding=1).backend == "cpu"
    with nc.use_backend("torch"):
        assert nc.explain("conv", x, w, padding=1).backend == "torch"


@pytest.mark.parametrize("initial, final, words", [
    (3.80, 0.0095, "400x lower"), (3.8, 1.9, "50% lower"), (3.8, 0.3, "12.7x lower"),
    (2.0, 2.2, "10% higher"), (2.0, 0.0, "down to zero")])
def test_lstm_demo_loss_change(initial, final, words):
    from numbaconv.demos.lstm import loss_change
    assert loss_change(initial, final) == words


def test_kernels_compile_at_numbaconvs_llvm_level(monkeypatch):
    """The level is Numba's config.OPT during the kernel's compilation only (its pass
    pipelines read it then), NUMBACONV_LLVM_OPT chooses it, NUMBA_OPT set leaves Numba's."""
    from numba.core import config as numba_config

    class Dispatcher:
        def compile(self, sig):
            seen.append(int(numba_config.OPT))
            return sig

    monkeypatch.delenv("NUMBA_OPT", raising=False)
    monkeypatch.delenv("NUMBACONV_LLVM_OPT", raising=False)
    assert config.llvm_opt_level() == config.LLVM_OPT_LEVEL == 2
    # The real kernels carry the wrapper (decorated at import, with NUMBA_OPT unset here
    # and in CI).
    from numbaconv.cpu import conv_backward_bias
    kernels = [v for v in vars(conv_backward_bias).values() if hasattr(v, "py_func")]
    assert kernels and all("compile" in vars(k) for k in kernels)
    before = numba_config.OPT
    seen = []
    assert config._at_opt_level(Dispatcher()).compile("sig") == "sig"
    assert seen == [2] and numba_config.OPT == before
    monkeypatch.setenv("NUMBACONV_LLVM_OPT", "1")
    seen = []
    config._at_opt_level(Dispatcher()).compile("sig")
    assert seen == [1] and numba_config.OPT == before
    monkeypatch.setenv("NUMBACONV_LLVM_OPT", "fast")
    with pytest.raises(ValueError, match="NUMBACONV_LLVM_OPT"):
        config.llvm_opt_level()
    monkeypatch.setenv("NUMBA_OPT", "3")
    assert config.llvm_opt_level() is None
    plain = Dispatcher()
    assert config._at_opt_level(plain) is plain and "compile" not in vars(plain)
