"""Benchmarks call the library through its public surface (issue #33): no private name imported or reached into, no
library attribute reassigned (monkeypatching), no benchmark importing another (they share benchmarks/common.py),
and every library name they import exists. And benchmarks/ stays sorted (issue #51): scripts in its folders, and
every benchmarks/ path the documents, configs, scripts and tests cite is there, or is a run artifact that left the
tree and benchmarks/logs/ARTIFACTS.tsv says where it is kept. And train_step_speed.py's DFlash-against-DFlash2 step
(issue #53) runs on the CPU."""

from __future__ import annotations

import ast
import functools
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("speed", "quality", "smoke", "device", "overlays")  # benchmarks/README.md says what each holds
BENCHMARKS = sorted(path for folder in FOLDERS for path in (ROOT / "benchmarks" / folder).glob("*.py"))
SCRIPTS = sorted(path for folder in FOLDERS for path in (ROOT / "benchmarks" / folder).glob("*.sh"))
SHARED = "common"
# Where a benchmarks/ path is cited as it is now: the journal and the run folders keep paths as they were run.
CITING = ("README.md", "benchmarks/README.md", "benchmarks/RESULTS.md", "docs",
          "config", "benchmarks/speed", "benchmarks/quality", "benchmarks/smoke", "benchmarks/device",
          "benchmarks/overlays", "tests", "rules", "workflow", "src")


def private_names_of_the_library() -> set[str]:
    """``_names`` the library defines: its private functions, methods and instance attributes."""
    names = set()
    for path in (ROOT / "src" / "dflash_pipeline").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name.startswith("_"):
                names.add(node.name)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr.startswith("_"):
                names.add(node.attr)
    return {name for name in names if not name.startswith("__")}


def root_name(node) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def violations(path: Path, private: set[str]) -> list[str]:
    tree = ast.parse(path.read_text())
    siblings = {p.stem for p in BENCHMARKS} - {path.stem, SHARED}
    library: set[str] = set()  # names bound to library modules or objects imported from it
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] == "dflash_pipeline":
                library.update(alias.asname or alias.name for alias in node.names)
                found += [f"imports the private name {alias.name} from {node.module}" for alias in node.names
                          if alias.name.startswith("_")]
            if node.module.split(".")[0] in siblings or node.module.startswith("benchmarks"):
                found.append(f"imports the benchmark {node.module}")
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "dflash_pipeline":
                    library.add(alias.asname or alias.name.split(".")[0])
                    found += [f"imports {alias.name}"] if any(p.startswith("_") for p in alias.name.split(".")) else []
                if alias.name.split(".")[0] in siblings or alias.name.startswith("benchmarks"):
                    found.append(f"imports the benchmark {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in private:
            found.append(f"line {node.lineno}: reaches into the library's private {node.attr}")
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in [t for t in targets for t in (t.elts if isinstance(t, ast.Tuple) else [t])]:
            if isinstance(target, ast.Attribute) and root_name(target) in library:
                found.append(f"line {node.lineno}: assigns {ast.unparse(target)} (monkeypatching the library)")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                and node.args and root_name(node.args[0]) in library:
            found.append(f"line {node.lineno}: {node.func.id} on {ast.unparse(node.args[0])}")
    if "monkeypatch" in path.read_text():
        found.append("mentions monkeypatch")
    return [f"{path.name}: {problem}" for problem in found]


def test_the_checks_catch_what_they_look_for(tmp_path):
    """A benchmark doing each forbidden thing is named (the checks below are not vacuous)."""
    bad = tmp_path / "bad.py"
    bad.write_text("from dflash_pipeline.drafter import _layer_pass\nfrom dflash_pipeline import greedy\n"
                   "import recipe_study\ngreedy.DROP_SHARE = 0.5\nsetattr(greedy, 'x', 1)\nstore._shard(0)\n"
                   "# monkeypatch\n")
    assert len(violations(bad, {"_shard"})) == 6, violations(bad, {"_shard"})


def test_benchmarks_use_the_public_surface_only():
    private = private_names_of_the_library()
    assert {"_load", "_loading", "_rows"} <= private  # e.g. Preloaded's, HiddenStateStore's
    problems = [problem for path in BENCHMARKS for problem in violations(path, private)]
    for script in SCRIPTS:  # inline Python in the shell scripts
        problems += [f"{script.name}: {line.strip()}" for line in script.read_text().splitlines()
                     if re.search(r"from dflash_pipeline[\w.]* import .*\b_\w", line) or "monkeypatch" in line]
    assert not problems, "\n".join(problems)


def test_every_library_name_a_benchmark_imports_exists():
    missing = []
    for path in BENCHMARKS:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dflash_pipeline"):
                module = importlib.import_module(node.module)
                missing += [f"{path.name}: {node.module}.{alias.name}" for alias in node.names
                            if not hasattr(module, alias.name)
                            and importlib.util.find_spec(f"{node.module}.{alias.name}") is None]
    assert not missing, missing


def test_benchmarks_top_level_holds_only_the_shared_module_the_documents_and_the_folders():
    top = {path.name for path in (ROOT / "benchmarks").iterdir()}
    assert top <= {"common.py", "README.md", "RESULTS.md", "journal", "logs", *FOLDERS}, sorted(top)
    assert len(BENCHMARKS) > 20 and len(SCRIPTS) > 5  # the folders are read


def cited_benchmark_paths(text: str) -> set[str]:
    """``benchmarks/...`` paths in a text, without a run's own ``results/benchmarks/`` and without wildcards."""
    found = re.findall(r"(?<![\w/.~$])(?<!glob\(\")benchmarks/[\w./-]*[\w/]", text)
    return {path.rstrip("/.") for path in found if "*" not in path and "<" not in path}


def test_every_cited_benchmarks_path_exists(tmp_path):
    (tmp_path / "doc.md").write_text("see benchmarks/speed/nothing.py and results/benchmarks/train.tsv, "
                                     "`benchmarks/smoke/gpu_smoke.sh`.")
    assert cited_benchmark_paths((tmp_path / "doc.md").read_text()) == {"benchmarks/speed/nothing.py",
                                                                        "benchmarks/smoke/gpu_smoke.sh"}
    files = [path for name in CITING for path in ([ROOT / name] if (ROOT / name).is_file()
                                                   else sorted((ROOT / name).rglob("*")))
             if path.is_file() and path.suffix in {".md", ".py", ".sh", ".yaml", ".smk", ".toml"}
             and path != Path(__file__)]
    removed = {row["path"] for row in artifacts() if row["status"] == "removed"}
    missing = sorted(f"{path.relative_to(ROOT)}: {cited}" for path in files
                     for cited in cited_benchmark_paths(path.read_text())
                     if not (ROOT / cited).exists() and cited not in removed)
    assert not missing, "\n".join(missing)


def artifacts() -> list[dict]:
    lines = (ROOT / "benchmarks" / "logs" / "ARTIFACTS.tsv").read_text().splitlines()
    return [dict(zip(lines[0].split("\t"), line.split("\t"))) for line in lines[1:]]


def test_each_artifact_is_out_of_the_tree_or_kept_and_its_commit_holds_it():
    """A removed artifact is not tracked and the commit ARTIFACTS.tsv names holds it (where this clone has that
    commit: a shallow clone has not); a kept one is tracked. Trees only: no blob is fetched in a blobless clone."""
    rows = artifacts()
    assert {row["status"] for row in rows} == {"removed", "kept"}
    git = functools.partial(subprocess.run, cwd=ROOT, capture_output=True, text=True)
    tracked = set(git(["git", "ls-files", "benchmarks/logs"], check=True).stdout.split())
    for row in rows:
        assert (row["path"] in tracked) == (row["status"] == "kept"), row["path"]
        if git(["git", "cat-file", "-e", row["commit"] + "^{commit}"]).returncode == 0:
            entry = git(["git", "ls-tree", row["commit"], "--", row["path"]], check=True).stdout.split()
            assert entry[1:2] == ["blob"], (row["path"], row["commit"])


def test_train_step_speed_times_both_architectures_whole_steps_on_the_cpu():
    """``--architectures dflash dflash2 --profile``: a row per architecture (the DFlash2 drafter with the overlay's
    keys and the selector's parameters), memory — on the CPU, the ratio line, then each step's top operators."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "speed" / "train_step_speed.py"), "--architectures", "dflash",
         "dflash2", "--sequences", "2", "--length", "32", "--max-anchors", "2", "--repeats", "1", "--warmup", "1",
         "--profile"],
        cwd=ROOT, capture_output=True, text=True, check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")})
    lines = result.stdout.splitlines()
    built = {line.split(":")[0]: line for line in lines if line.startswith(("dflash:", "dflash2:")) and "built" in line}
    assert "'architecture': 'dflash2'" in built["dflash2"] and "'selector_rank': 256" in built["dflash2"]
    assert "'conv_kernel_size': 2" in built["dflash2"] and "conv_kernel_size" not in built["dflash"]
    header = lines.index(next(line for line in lines if line.startswith("architecture")))
    ratio_line = lines.index(next(line for line in lines if line.startswith("dflash2 / dflash")))
    rows = {line.split()[0]: line.split() for line in lines[header + 1 : ratio_line]}
    assert set(rows) == {"dflash", "dflash2"}, result.stdout
    for name, (_, seconds, tokens_per_s, cpu, peak, trainable) in rows.items():
        assert float(seconds) > 0 and float(tokens_per_s) > 0 and float(cpu) > 0 and peak == "—", name
    parameters = {name: int(row[5].replace(",", "")) for name, row in rows.items()}
    assert parameters["dflash2"] > parameters["dflash"] > 0  # the convolutions and the selector's codebooks
    ratio = re.search(r"^dflash2 / dflash: s/step ([\d.]+), CPU s ([\d.]+), peak memory —, trainable parameters "
                      r"([\d.]+)$", result.stdout, re.M)
    assert ratio and float(ratio[3]) == round(parameters["dflash2"] / parameters["dflash"], 3), result.stdout
    for name, (_, seconds, *_) in rows.items():  # the profile: its operators' time beside the timed step, and a table
        busy = re.search(rf"^{name}: operators \(own CPU time\) ([\d.]+) s per step against {seconds} s timed",
                         result.stdout, re.M)
        assert busy and float(busy[1]) > 0, result.stdout
    assert result.stdout.count("aten::mm") >= 2  # a table of operators per architecture
