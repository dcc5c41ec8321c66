"""tfpipe trainers: `python -m trainers.main --flagfile=configs/<workload>_<method>.cfg`."""
