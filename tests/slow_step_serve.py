"""`flexengine serve` whose every model step first sleeps SLOW_STEP_S: a test server whose engine is
mid-step nearly all the time (tests/test_engine_process.py).

    python tests/slow_step_serve.py serve --port 8000 ...

A test hook kept out of the product: the engine process, spawned, re-imports this file as __mp_main__,
and only there, where the model runs, is the step slowed.
"""
import time

SLOW_STEP_S = 0.25

if __name__ == "__mp_main__":
    from flexengine.engine.model_runner import ModelRunner

    execute = ModelRunner.execute

    def slow_execute(self, batch, prev=None):
        time.sleep(SLOW_STEP_S)
        return execute(self, batch, prev)

    ModelRunner.execute = slow_execute

if __name__ == "__main__":
    from flexengine import cli
    raise SystemExit(cli.main())
