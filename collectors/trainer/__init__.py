"""The reference pipeline trainer: the configuration (``config``: ``CollectConfig``, presets, refusals), a readable
Transformer cut into stages (``model``), synthetic data (``data``), P2P transport (``comm``), one stage's share of a
step in schedule order (``pipeline``), the per-rank training loop (``train``), the known workload's held passes
(``workload``) and the single-process run every pipeline run must reproduce (``reference``)."""
