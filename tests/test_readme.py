"""Every snippet of the README runs as printed: each ```python block is executed (in a fresh
namespace, output captured), and each ``numbaconv ...`` command of a shell block parses with
the command line's own parser. The set-up section keeps the test command CI runs.

A python block that cannot run here (it needs a GPU or an optional extra) starts with a
comment ``# readme-test: needs MODULE`` and is skipped, with that reason, where the module is
missing. The README's blocks need nothing beyond numbaconv and NumPy today.
"""

import contextlib
import io
import pathlib
import re
import shlex

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
SHELLS = ("bash", "sh", "console", "shell")


def blocks(language):
    """(line number, code) of every fenced block of ``language`` in the README."""
    text = README.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 1, m.group(2)) for m in FENCE.finditer(text)
            if m.group(1) in language]


def python_blocks():
    return [code for _, code in blocks(("python",))]


def run_block(code, name):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, name, "exec"), {"__name__": "__readme__"})
    return out.getvalue()


PYTHON = blocks(("python",))


@pytest.mark.parametrize("line,code", PYTHON, ids=[f"line{n}" for n, _ in PYTHON])
def test_every_python_block_runs(line, code):
    need = re.match(r"# readme-test: needs (\w+)", code)
    if need:
        pytest.importorskip(need.group(1),
                            reason=f"README.md line {line} needs {need.group(1)}")
    run_block(code, f"README.md (line {line})")


def test_the_readme_has_python_blocks_to_run():
    assert len(PYTHON) >= 3  # conv quickstart, RNN training step, backends


def test_the_rnn_training_step_prints_what_its_comment_says():
    [snippet] = [block for block in python_blocks() if "rnn_reserve_size" in block]
    assert run_block(snippet, "README.md (rnn training step)").strip() == "(512, 128)"


def numbaconv_commands():
    """Every ``numbaconv ...`` command in the README's shell blocks, as argument lists
    (prompts, comments, environment assignments and ``&&`` chains taken apart)."""
    commands = []
    for line_number, code in blocks(SHELLS):
        for line in code.splitlines():
            line = line.strip()
            if line.startswith("$ "):
                line = line[2:]
            if not line or line.startswith("#"):
                continue
            for part in re.split(r"&&|;|\|\|", line):
                words = shlex.split(part, comments=True)
                while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
                    words = words[1:]
                if words[:1] == ["numbaconv"]:
                    commands.append((line_number, words[1:]))
                elif words[:3] in (["python", "-m", "numbaconv"],
                                   ["python3", "-m", "numbaconv"]):
                    commands.append((line_number, words[3:]))
    return commands


def test_the_readme_shows_numbaconv_commands():
    names = {args[0] for _, args in numbaconv_commands() if args}
    assert {"info", "check", "bench", "warmup", "demo"} <= names


@pytest.mark.parametrize("line,args", numbaconv_commands(),
                         ids=[" ".join(a) for _, a in numbaconv_commands()])
def test_every_numbaconv_command_parses(line, args):
    from numbaconv.cli import build_parser
    parser = build_parser()
    try:
        namespace = parser.parse_args(args)
    except SystemExit as exc:  # argparse reports a bad command line by exiting
        pytest.fail(f"README.md line {line}: `numbaconv {' '.join(args)}` does not parse "
                    f"(exit {exc.code})")
    assert namespace is not None


def test_the_setup_keeps_the_test_command_ci_runs():
    text = README.read_text(encoding="utf-8")
    setup = text[text.index("## Set-up: two commands"):]
    setup = setup[:setup.index("\n## ")]
    assert "```bash\npython -m pytest\n```" in setup
    assert "bash .ci/run" in setup
    assert (README.parent / ".ci" / "run").exists()
