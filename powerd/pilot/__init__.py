"""The A/B pilot: the same workload on a baseline window and a managed window, compared
from a controller's store and a throughput source (`powerd pilot report`; docs/operations.md,
"Pilot").

- `windows`: the two windows from the command line (ISO 8601 with a time zone);
- `source`: what the store recorded over a window (per-minute SQL aggregates), and the
  throughput from the agents' reported perf or from a Prometheus range query;
- `figures`: the report's numbers from those, and the comparison (pure);
- `render`: the JSON file, the HTML page with its plots, the text summary;
- `report`: the two steps together, for the command line.

Only `windows` loads without the `controller` extra (numpy, SQLAlchemy); the plots need
matplotlib (the `sim` extra).
"""
