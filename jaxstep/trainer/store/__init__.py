"""What a run keeps on disk and reads back: the run directory and its lock (``run_dir``),
JSON lines and atomic files (``records``), checkpoint writes (``checkpoint``) and the one
verified read (``checkpoint_read``, ``integrity``, and the older layouts it converts:
``block_layout``, ``param_layout``), the host-side run position (``run_state``), the one
resume both clients call (``resume``) and the echoes of a reported failure dropped
(``orbax_echoes``)."""
