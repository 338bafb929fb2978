"""The host side of a round: one decoding call driven from the host (`stream`), multi-turn tool rollouts
(`multiturn`), a round in the order it runs (`round`), asynchronous rounds (`async_rounds`), held-out evaluation
(`evaluation`), the round's fixed shapes and their compilation ahead (`shapes`). May import `config`, `algo`,
`device`, `data`, `rewards`, `tools` and `io`; never `api`.
"""
