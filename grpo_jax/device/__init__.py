"""Where arrays live: the mesh and partition specs (`sharding`), multi-host start-up (`distributed`), XLA:CPU
speed-ups behind one switch (`cpu`) and accelerator chips' specs (`chips`). May import `config` and `models`.
"""
