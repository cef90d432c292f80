"""Starting peers: their processes and logs (``processes.py``), one run's plan of ranks,
cluster and progress (``plan.py``), and the forkserver that forks them from a process that
imported torch once (``forkserver.py``). Import the module that holds a name."""
