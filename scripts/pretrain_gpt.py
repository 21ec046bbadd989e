"""Pretrain a GPT model with megatron-core: `torchrun --nproc_per_node N scripts/pretrain_gpt.py ...`.

Flags are Megatron-LM's (see `--help`); `--config FILE.yaml` supplies them from a file.
"""

import sys

from megatron_parcae.training.pretrain import pretrain

if __name__ == "__main__":
    sys.exit(pretrain("gpt"))
