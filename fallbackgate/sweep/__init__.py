"""The budget sweep: workload, grid of controller runs, metrics, plots and Belady's MIN floor."""
