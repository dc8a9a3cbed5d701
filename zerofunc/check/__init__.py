"""python -m zerofunc.check: the planner held against real training steps, on this machine.

world.py    simulated worlds: rank 0 of N on one device, through PyTorch's fake process group
cells.py    one (stage, world size) cell: the plan simulated, the same step run, both measured
env.py      the environment report (versions, device, backends, fast paths)
calibrate.py  a GPU's sustained matmul rates and bandwidth, for its hardware profile
"""
