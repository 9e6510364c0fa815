"""What a run reports while it trains: the metrics records read back one update late
(``metrics``), model FLOPs utilization (``mfu``), external trackers and their backends
(``trackers``, ``backends``), the loss plot (``loss_plot``), profiler traces (``profiler``)
and failures of the writer threads behind them (``threads``)."""
