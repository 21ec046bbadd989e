"""Damages what one received message of an exchange holds, once per job, as a peer killed
mid-send or a communicator aborted after `wait()` returned would leave it.

PARCAE_TEST_DAMAGE="KIND:WHAT[,KIND:WHAT...]": KIND is `migration` or `snapshot`
(reconfig/transfer.py's messages, on WORLD: a snapshot copy's tag is reconfig.copies._TAG's), WHAT is
`flip` (one byte changed) or `truncate` (the second half of the chunk never arrived:
zeros). Each is done once in the job: the first process to claim
PARCAE_TEST_DAMAGE_DIR/KIND-WHAT does it."""

import os

if os.environ.get("PARCAE_TEST_DAMAGE"):
    import torch.distributed as dist

    _WANTED = [tuple(item.split(":")) for item in os.environ["PARCAE_TEST_DAMAGE"].split(",")]
    _SNAPSHOT_TAG = 2 * 7_000_000
    _real = dist.batch_isend_irecv

    def _claim(kind: str, what: str) -> bool:
        try:
            os.close(os.open(os.path.join(os.environ["PARCAE_TEST_DAMAGE_DIR"], f"{kind}-{what}"),
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False

    class _Damaging:
        def __init__(self, work, tensor, what) -> None:
            self.work, self.tensor, self.what = work, tensor, what

        def wait(self, *args, **kwargs):
            result = self.work.wait(*args, **kwargs)
            if self.what == "flip":
                self.tensor.view(-1)[:1].view(dtype=__import__("torch").uint8)[1] ^= 0x10
            else:
                self.tensor.view(-1)[self.tensor.numel() // 2:] = 0.0
            return result

        def __getattr__(self, name):
            return getattr(self.work, name)

    def _batch_isend_irecv(ops):
        works = _real(ops)
        out = list(works)
        for i, op in enumerate(ops):
            receiving = getattr(op.op, "__name__", "") == "irecv" and op.group is dist.GroupMember.WORLD
            kind = "snapshot" if op.tag == _SNAPSHOT_TAG else "migration"
            for wanted_kind, what in _WANTED:
                if receiving and kind == wanted_kind and op.tensor.numel() > 1 and _claim(kind, what):
                    out[i] = _Damaging(works[i], op.tensor, what)
                    break
        return out

    dist.batch_isend_irecv = _batch_isend_irecv
