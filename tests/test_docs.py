"""The README and docs/ point only at what exists, and docs/benchmarks.md is what
docs/benchmarks/render.py writes from the committed bench JSON files."""

import importlib.util
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
#: A backticked path inside the repository: starts with one of its top-level folders.
REPO_PATH = re.compile(r"`((?:numbaconv|tests|docs|plugins|benchmarks|\.ci)/[\w./-]*)`")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: pathlib.Path) -> set:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


def render_module():
    spec = importlib.util.spec_from_file_location(
        "render_benchmarks", ROOT / "docs" / "benchmarks" / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_paths_exist(page):
    text = page.read_text(encoding="utf-8")
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):  # http(s), mailto: not checked here
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no such heading)")
    for path in REPO_PATH.findall(text):
        if not (ROOT / path).exists():
            broken.append(f"`{path}`")
    assert not broken, f"{page.relative_to(ROOT)} points at what does not exist: {broken}"


def test_the_readme_names_no_file_outside_the_repository():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for name in re.findall(r"`([\w./-]+\.md)`", text):
        assert (ROOT / name).exists(), name
    assert "API.md" not in text  # the contract ships as docs/api.md


def test_the_api_page_carries_the_contract_and_marks_the_additions():
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert text.startswith("# numbaconv public API contract")
    additions = text[text.index("## Beyond the contract"):]
    assert "warmup(" in additions


def test_the_benchmarks_page_is_up_to_date():
    render = render_module()
    assert list((ROOT / "docs" / "benchmarks").glob("*.json")), "no bench JSON committed"
    expected = render.render()
    actual = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert actual == expected, ("docs/benchmarks.md is stale: run "
                                "python docs/benchmarks/render.py")


def test_the_conv_section_has_command_date_versions_and_a_row_per_measurement():
    render = render_module()
    [path] = sorted((ROOT / "docs" / "benchmarks").glob("*.json"))[:1]
    record = json.loads(path.read_text(encoding="utf-8"))
    text = render.render_record("machine", record, f"docs/benchmarks/{path.name}")
    assert text.startswith("## machine: convolutions")
    assert f"- date: {record['created']}" in text
    assert "numbaconv bench" in text and f"--json docs/benchmarks/{path.name}" in text
    assert f"NumPy {record['environment']['numpy']}" in text
    keys = {(r["shape"], r["layout"], r["op"]) for r in record["results"]}
    for shape, layout, op in keys:
        assert f"| {shape} | {layout} | {op} |" in text


def test_the_conv_section_renders_the_copy_fractions():
    render = render_module()
    [path] = sorted((ROOT / "docs" / "benchmarks").glob("*.json"))[:1]
    record = json.loads(path.read_text(encoding="utf-8"))
    row = dict(record["results"][0], status="ok", median_s=2e-3, traffic_bytes=10**7,
               copy_fraction=0.25)
    text = render.render_record("m", dict(record, results=[row]), "docs/benchmarks/m.json")
    assert "Memory-bound rows" in text
    # 10 MB in 2 ms is 5 GB/s; a quarter of the copy's rate, 20 GB/s.
    assert "| 10.0 MB | 5.0 GB/s | 20.0 GB/s | 25% |" in text
    assert "Memory-bound rows" not in render.render_record("m", record, "m.json")


def test_the_conv_section_says_how_the_engines_ran():
    render = render_module()
    [path] = sorted((ROOT / "docs" / "benchmarks").glob("*.json"))[:1]
    record = json.loads(path.read_text(encoding="utf-8"))
    for engines, line in [("processes", "each timed in a process of its own"),
                          ("in-process", "all timed in one process (`--in-process`)")]:
        ran = dict(record, engines=engines)
        command = render.conv_command(ran, "m.json")
        assert command.endswith(" --json m.json")
        assert ("--in-process" in command) == (engines == "in-process")
        assert f"- engines: {line}" in render.render_record("m", ran, "docs/benchmarks/m.json")


def test_the_rnn_and_gpu_suites_render():
    render = render_module()
    rnn = dict(created="2026-01-01T00:00:00+0000", suite="rnn", quick=True, repeat=3,
               threads=2, dtype="float32", environment=dict(numbaconv="0", numpy="2"),
               rows=[dict(case="lstm_T10_N8_32", mode="lstm", T=10, N=8, pytorch_s=0.002,
                          cpu_s=0.001, cpu_ratio=2.0, cpu_reserve_bytes=2**20,
                          cpu_alloc_bytes=2**21)])
    text = render.render_record("m", rnn, "docs/benchmarks/m.json")
    assert "numbaconv bench --suite rnn --quick" in text
    assert "| lstm_T10_N8_32 | 10 | 8 | 2.00 ms | 1.00 ms | 2.00 | 1.0 MiB | 2.0 MiB |" in text
    assert "not checked against PyTorch" in text
    rnn["check"] = dict(against="pytorch 2.13", tolerance=5e-4, failed=1)
    rnn["rows"].append(dict(case="gru_T3_N2_4_5", mode="gru", T=3, N=2, cpu_status="FAIL"))
    text = render.render_record("m", rnn, "docs/benchmarks/m.json")
    assert "checked first against pytorch 2.13: y, dx and the weight gradients" in text
    assert "| gru_T3_N2_4_5 | 3 | 2 |  | FAIL |" in text
    gpu = dict(created="2026-01-01T00:00:00+0000", suite="conv-cuda", finished=True,
               environment={}, settings=dict(sim=False, quick=True),
               rows=[dict(case="resnet", layout="channels_first", op="conv", gflop=1.0,
                          status="ok", algorithm="implicit_gemm", ours_ms=2.0,
                          torch_ieee_ms=3.0, torch_tf32_ms=1.0)])
    text = render.render_record("h200", gpu, "docs/benchmarks/h200.json")
    assert "numbaconv bench --device cuda --quick" in text
    assert ("| resnet | channels_first | conv | implicit_gemm | ok | 2.000 ms | 3.000 ms | "
            "1.50 | 1.000 ms | 0.50 |") in text
    with pytest.raises(ValueError):
        render.render_record("x", {"created": "?"}, "docs/benchmarks/x.json")


def test_the_configuration_page_lists_every_documented_variable():
    from numbaconv import config
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    section = text[text.index("## Environment variables"):]
    section = section[:section.index("\n## ")]
    in_table = re.findall(r"`(NUMBACONV_\w+)`", "\n".join(
        line.split("|")[1] for line in section.splitlines() if line.startswith("| `")))
    assert set(in_table) == set(config.documented_variables())
