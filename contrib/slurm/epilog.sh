#!/bin/sh
# Slurm EpilogSlurmctld for powerd: delete the job (contrib/slurm/powerd_slurm.py).
# It never fails the job: whatever happens, exit 0 (bounded by a timeout).
here=$(dirname "$0")
python=${POWERD_PYTHON:-/usr/bin/python3}
if [ -x /usr/bin/timeout ]; then
    /usr/bin/timeout 30 "$python" "$here/powerd_slurm.py" epilog || echo "powerd-slurm: epilog exited $?" >&2
else
    "$python" "$here/powerd_slurm.py" epilog || echo "powerd-slurm: epilog exited $?" >&2
fi
exit 0
