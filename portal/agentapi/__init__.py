"""The agent API, /api/agent/v1/, put together above the apps whose reports it takes
(docs/design.md section 2, "Layers"): a node's own reports (register, probe, heartbeat:
portal/nodes/agent_api.py), job reports (confirm, events, logs: jobs.py here, which turns an
event into the job's transition and the node's effects through portal/jobs/reports.py), and
the reports other apps add. urls.py lists them all.
"""
