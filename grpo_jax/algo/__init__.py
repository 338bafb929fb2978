"""The device side of GRPO as pure functions over pytrees: the trajectory (`trajectory`), sampling and the
resumable decoder (`sampling`, `decoder`, `decoder_pages`), log-probabilities (`logprobs`), the reference model
(`reference`), advantages and round options (`advantages`, `rounds`), the train state and step (`state`,
`train_step`), and `programs`, which jits them over the mesh, here and nowhere else; what the host calls of them
(`Programs`, `Decoder`, `RunShapes`) is typed in `program_types`, which imports nothing, so the round code holds
programs without importing their builders. May import `config`, `models`, `losses` and `device`; no I/O, no host
loop.
"""
