"""``numbaconv demo``: choosing a model, its options and messages (no training here; the
models themselves are run in test_demo_autoencoder.py and test_cli.py)."""

import importlib.util

import pytest

from numbaconv import demos
from numbaconv.__main__ import main
from numbaconv.demos import autoencoder, cnn, lstm


def run_cli(capsys, *argv):
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.fixture
def calls(monkeypatch):
    """Replace each demo's run_demo by a recorder returning 0."""
    record = []
    for name in demos.DEMOS:
        module = demos.load(name) if not demos.missing_requirements(name) else None
        if module is not None:
            monkeypatch.setattr(module, "run_demo",
                                lambda _name=name, **kw: record.append((_name, kw)) or 0)
    return record


@pytest.fixture
def without_sklearn(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "sklearn" else real(name, *a))


def test_bare_demo_runs_the_autoencoder_when_sklearn_is_installed(capsys, calls):
    pytest.importorskip("sklearn")
    status, _, err = run_cli(capsys, "demo", "--epochs", "3", "--seed", "5")
    assert status == 0 and err == ""
    [(name, options)] = calls
    assert name == "autoencoder" and (options["epochs"], options["seed"]) == (3, 5)


def test_bare_demo_falls_back_to_the_cnn_without_sklearn(capsys, calls, without_sklearn):
    status, _, err = run_cli(capsys, "demo")
    assert status == 0
    assert [name for name, _ in calls] == ["cnn"]
    assert "needs sklearn" in err and 'pip install "numbaconv[demo]"' in err


def test_autoencoder_without_sklearn_says_what_to_install(capsys, without_sklearn):
    status, _, err = run_cli(capsys, "demo", "autoencoder")
    assert status == 1
    assert 'pip install "numbaconv[demo]"' in err


@pytest.mark.parametrize("name", ["cnn", "lstm"])
def test_demos_without_extra_packages_are_reachable_by_name(capsys, calls, name):
    assert run_cli(capsys, "demo", name, "--epochs", "2")[0] == 0
    assert calls[0][0] == name and calls[0][1]["epochs"] == 2


def test_output_is_passed_to_the_autoencoder_only(capsys, calls, tmp_path):
    pytest.importorskip("sklearn")
    assert run_cli(capsys, "demo", "autoencoder", "--output", str(tmp_path / "a.png"))[0] == 0
    assert calls[0][1]["output"] == str(tmp_path / "a.png")
    status, _, err = run_cli(capsys, "demo", "cnn", "--output", "x.png")
    assert status == 2 and "--output" in err


@pytest.mark.parametrize("argv, message", [
    (("demo", "cnn", "--epochs", "0"), "--epochs"),
    (("demo", "cnn", "--backend", "no_such_backend"), "no_such_backend"),
    (("demo", "lstm_not_yet"), "invalid choice"),
])
def test_usage_errors(capsys, argv, message):
    status, _, err = run_cli(capsys, *argv)
    assert status == 2 and message in err


def test_every_listed_demo_has_the_interface():
    for name in demos.DEMOS:
        if demos.missing_requirements(name):
            continue
        module = demos.load(name)
        assert isinstance(module.DEFAULT_EPOCHS, int) and callable(module.run_demo)


def test_help_states_the_default_epochs(capsys):
    main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert (f"autoencoder {autoencoder.DEFAULT_EPOCHS}, cnn {cnn.DEFAULT_EPOCHS}, "
            f"lstm {lstm.DEFAULT_EPOCHS}") in out
    for name in demos.DEMOS:
        assert name in out


def test_load_rejects_unknown_names():
    with pytest.raises(ValueError, match="name"):
        demos.load("nope")
