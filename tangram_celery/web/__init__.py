"""Tangram's HTTP front door (`tangram serve`): SandboxFusion-compatible `/run_code` and
`/v1/ping`, native `/tangram/v1/...` endpoints, and remote reward endpoints for OpenRLHF and
slime, all in front of `AsyncTangramClient`. Needs the `http` extra (FastAPI + uvicorn); nothing
here imports them until `create_app` is called."""
