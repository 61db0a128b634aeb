"""What the tests share; test modules import from here, not from each other.

What a test needs, and the guard that checks it:
- `needs`: the marks broker, postgres, browser, process, and the audit hook that fails a
  test using one without its mark (applied in tests/conftest.py).

Real parts a test starts or reaches:
- `amqttbroker`: amqtt, a second MQTT broker beside Mosquitto (powerd.testing.mosquitto);
- `mqttproxy`: a proxy that reads MQTT packets and can hold back or drop PUBACKs;
- `tcpproxy`: a TCP proxy a test closes and opens (a database that goes away);
- `pg`: a throwaway PostgreSQL database, and the two store backends as parameters.

powerd, run whole:
- `live_api`: the controller and its admin API in a thread of the test (in-process broker);
- `daemons`: a controller process restarted at will over the same files and database;
- `e2e`: a site of powerd processes and a monitor that checks every budget;
- `ha`: a standby pair of controller processes on one PostgreSQL database;
- `cli`: `python -m powerd.cli` as a user runs it.

Parts, driven by hand:
- `clock`: virtual time the test moves;
- `honest`, `hostile`: agents as state machines, and what attacking ones send;
- `planner`: small fleets for the safety planner;
- `allocator`, `sim`: synthetic policies and scenarios;
- `leases`: waiting for a lease to lapse;
- `schema`: fuzzing the admin API against its OpenAPI document.
"""
