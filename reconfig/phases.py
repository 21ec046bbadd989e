"""The phases of an in-place layout change, in the order the executor goes through them.

Every worker times its own (reconfig/execute.py) and the reporting rank's go into the
change's LayoutChange event; the migration cost model (megatron_parcae/liveput/cost.py)
predicts the same phases, so that its constants are fitted on measured phases, each
against the quantity it grows with. A phase includes waiting for the slowest peer where
it ends at a meeting point (WORLD's handshake, the receipt of a slice, the built layout).
"""

EXPORT = "export"  # held state copied out of the old layout into host memory
WORLD = "world"  # the old layout released, WORLD re-formed for the generation, progress agreed
EXCHANGE = "exchange"  # the plan's slices sent and received
BUILD = "build"  # the new layout's process groups, model, DDP and optimizer, on every member
IMPORT = "import"  # kept and received state written into the new model and optimizer

PHASES = (EXPORT, WORLD, EXCHANGE, BUILD, IMPORT)
