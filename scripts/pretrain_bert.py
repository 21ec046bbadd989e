"""Pretrain a BERT model with megatron-core: `torchrun --nproc_per_node N scripts/pretrain_bert.py ...`.

Flags are Megatron-LM's (see `--help`); `--config FILE.yaml` supplies them from a file.
"""

import gc
import sys

if __name__ == "__main__":
    gc.disable()  # through imports and set-up, until the loop freezes what they built: training/loop.py
    # Imported here: the process the checkpoint writer's results queue is served from
    # imports this file again as a module, and needs none of the training code.
    from megatron_parcae.training.pretrain import pretrain

    sys.exit(pretrain("bert"))
