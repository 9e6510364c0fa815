"""The one update loop (``loop``), the hook contract (``hooks``), the built-in hooks
(``builtin_hooks``, ``nonfinite_guard``, ``callbacks``), stop signals (``signals``) and the
one function that assembles a loop for every client (``assembly``)."""
