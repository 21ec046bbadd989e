"""Training scalars for dashboards (--tensorboard-dir, --wandb-project), made from the
typed events of megatron_parcae/events.py: one writer, one module per back-end."""
