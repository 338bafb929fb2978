"""What a run reads and writes outside the devices: checkpoints (`checkpoint`), the exported policy (`export`),
run folders and their lock (`runs`, `lock`), preemption handling (`preemption`), metrics and completions
(`reporting`, `trackers`). May import `config` and `models` (and, in `export`, `algo` and `data`).
"""
