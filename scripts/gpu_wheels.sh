#!/usr/bin/env bash
# Fetch, on a machine with network, what scripts/gpu_check.sh installs offline on a GPU
# machine that has its own torch: the wheels megatron-parcae needs beside that torch
# (megatron-core, etcd3, tenacity, protobuf, grpcio; Prophet, which the coordinator's
# forecaster uses, with cmdstanpy, stanio and holidays) and an etcd server.
#
#   bash scripts/gpu_wheels.sh [--dry-run] [--python-version 3.12] [--etcd-version 3.5.17]
#                              [--etcd-from DIR] [DIR]
#
# DIR (default gpu-wheels/) gets the wheels, built for the GPU machine's CPython
# (--python-version, Linux x86-64) without their dependencies (torch, numpy and the rest
# are the machine's own), etcd in DIR/etcd/ (the release --etcd-version from GitHub, or
# the binary in --etcd-from, e.g. Debian's /usr/bin), and SHA256SUMS of it all: about
# 45 MiB, under the 64 MiB a device call carries.
# --dry-run prints every command and runs none.
set -euo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
PYTHON_VERSION=3.12
ETCD_VERSION=3.5.17
ETCD_FROM=""
DIR=gpu-wheels
PY=${PYTHON:-python3}
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --python-version) PYTHON_VERSION=${2:?--python-version needs a version}; shift ;;
    --etcd-version) ETCD_VERSION=${2:?--etcd-version needs a version}; shift ;;
    --etcd-from) ETCD_FROM=${2:?--etcd-from needs a folder}; shift ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu_wheels.sh: error: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) DIR=$1 ;;
  esac
  shift
done
case "$ETCD_VERSION" in
  3.5.0|3.5.1|3.5.2) echo "gpu_wheels.sh: error: etcd $ETCD_VERSION stops uncleanly (etcd-io/etcd issue 13766)" >&2
                     exit 2 ;;
esac

run() {
  echo "\$ $(printf '%q ' "$@")"
  [ "$DRY_RUN" = 1 ] || "$@"
}

# Binary wheels for the GPU machine's interpreter and platform, whatever this machine is.
TARGET=(--python-version "$PYTHON_VERSION" --implementation cp --platform manylinux2014_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --only-binary=:all:)
ETCD=etcd-v$ETCD_VERSION-linux-amd64

run mkdir -p "$DIR/etcd"
run "$PY" -m pip download --no-deps --dest "$DIR" "${TARGET[@]}" megatron-core==0.16.1 "protobuf>=4.22" grpcio \
  prophet==1.5.0 "cmdstanpy>=1.0.4" "stanio>=0.4,<2" "holidays>=0.25,<1"
# Pure Python: a wheel is built where the index has only the source.
run "$PY" -m pip wheel --no-deps --wheel-dir "$DIR" "etcd3>=0.12" "tenacity>=8.0"
if [ -n "$ETCD_FROM" ]; then
  run cp "$ETCD_FROM/etcd" "$DIR/etcd/"
else
  run curl -fsSL -o "$DIR/$ETCD.tar.gz" "https://github.com/etcd-io/etcd/releases/download/v$ETCD_VERSION/$ETCD.tar.gz"
  run tar -xzf "$DIR/$ETCD.tar.gz" -C "$DIR/etcd" --strip-components=1 "$ETCD/etcd"
  run rm "$DIR/$ETCD.tar.gz"
fi
echo "\$ (cd $(printf '%q' "$DIR") && sha256sum ./*.whl etcd/etcd > SHA256SUMS)"
if [ "$DRY_RUN" = 0 ]; then
  (cd "$DIR" && sha256sum ./*.whl etcd/etcd >SHA256SUMS)
  echo "gpu_wheels.sh: $DIR holds $(find "$DIR" -maxdepth 1 -name '*.whl' | wc -l) wheels and etcd $("$DIR/etcd/etcd" --version | head -n 1)"
fi
