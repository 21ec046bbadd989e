"""Which instances a job buys: pools of spot and on-demand instances, the deadline policy
that decides how many on-demand instances to hold, and the baselines it is measured
against. Plain data and arithmetic (leaves only), so the simulator, `parcae plan` and a
live coordinator decide with the same code."""
