"""Helpers of the Python tests that drive a local cluster (tests/metrics, tests/clients)."""
import os
import subprocess
import time


def wait_for(what, fn, seconds):
    """Calls fn until it returns something true (bounded in time); errors count as not yet."""
    deadline = time.time() + seconds
    last = None
    while time.time() < deadline:
        try:
            value = fn()
            if value:
                return value
        except Exception as e:  # not up yet
            last = e
        time.sleep(0.25)
    raise AssertionError(f"timed out after {seconds} s waiting for {what} (last error: {last})")


def stop(proc, seconds=30):
    """Stops a process (a `moe-cli up` cluster stops its children on SIGTERM): SIGTERM, then
    SIGKILL if it has not exited within `seconds`."""
    proc.terminate()
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()


def synth_checkpoint(moe_tool, work, preset, seed):
    """A skewed synthetic checkpoint of the preset under work/ckpt-<preset> (made once)."""
    os.makedirs(work, exist_ok=True)
    ckpt = os.path.join(work, f"ckpt-{preset}")
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        subprocess.run([moe_tool, "synth", "--config", preset, "--out", ckpt, "--seed", str(seed),
                        "--skew", "1.0"], check=True, stdout=subprocess.DEVNULL, timeout=300)
    return ckpt
