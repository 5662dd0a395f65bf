"""The messages every process exchanges and the errors a request can end in.

Typed, frozen dataclasses shared by the router, both worker roles, the planner and the
benchmarks: requests (`requests`), what comes back (`results`), engine reports (`reports`),
transfer handles (`transfer`), timings and percentiles (`timings`), and the error types with
what each tells a client (`errors`). Importable without vLLM, torch or Ray.
"""
