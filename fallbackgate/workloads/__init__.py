"""The probe's workloads as prompts files with arrival times: short chat, long retrieval, multi-turn tool use,
long reasoning and their phase-changing mix (``fallbackgate workload``).

`tokens` (the model's limit and tokens), `text` (bundled passages and the shared corpus), `arrivals`
(seeded arrival processes), `kinds` (one generator per :class:`WorkloadKind`, registered), `mixed` (phases),
`build` (a whole workload, checked and written).
"""
