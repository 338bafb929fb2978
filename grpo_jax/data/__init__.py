"""Prompts: reading rows from files or datasets (`sources`), tokenizing them and drawing seeded batches
(`prompts`), and the embedded digit-puzzle task (`task`). Imports no other subpackage but `config`.
"""
