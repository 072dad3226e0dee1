"""The README's self-contained code (the recurrent training step) runs as printed."""

import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


def test_the_rnn_training_step_runs():
    [snippet] = [block for block in python_blocks() if "rnn_reserve_size" in block]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(snippet, "README.md (rnn training step)", "exec"), {})
    assert out.getvalue().strip() == "(512, 128)"
