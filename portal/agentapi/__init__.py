"""The agent API, /api/agent/v1/, put together above the apps whose reports it takes
(docs/design.md section 2, "Layers"): a node's registration and queue probe
(portal/nodes/agent_api.py), the heartbeat (heartbeat.py: the node's record, its GPU samples,
the jobs it lists), job reports (jobs.py: confirm, events, logs, which turn an event into the
job's transition and the node's effects through portal/jobs/reports.py), and the reports other
apps add. urls.py lists them all.
"""
