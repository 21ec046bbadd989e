"""Training scalars for dashboards (--tensorboard-dir, --wandb-project), made from the
typed events of megatron_parcae/events.py, by one writer, to the back-ends of
megatron_parcae/scalars/."""
