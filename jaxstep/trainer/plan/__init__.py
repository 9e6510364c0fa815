"""A config turned into numbers and built once: derived values (``numbers``: vocabulary, K,
run and schedule length, mesh), automatic K (``auto_accum``), the memory ledger
(``memory``), the jitted steps (``steps``), the first parameters of a pretrained base
(``init_from``) and everything a run builds (``build``)."""
