"""Startup, readiness and liveness probes, run the way the kubelet runs them: httpGet (named
ports, IPv6 in brackets), tcpSocket and exec (inside the container's namespaces), with their
initialDelaySeconds, periodSeconds, timeoutSeconds, successThreshold and failureThreshold.
Readiness drives the container's `ready`; a failed startup or liveness probe kills it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import aiohttp

from tests.support.pod_state import ContainerState, PodRuntime, kill_container

logger = logging.getLogger(__name__)


class Prober:
    def __init__(self, session: aiohttp.ClientSession, problems: list[str]) -> None:
        self._session = session
        self.problems = problems  # probes this kubelet cannot run, reported to the test

    async def run(self, runtime: PodRuntime, container: ContainerState) -> None:
        """Startup first (if any), then readiness and liveness side by side, until cancelled."""
        spec = container.spec
        startup = spec.get("startupProbe")
        if startup is not None and not await self._loop(runtime, container, startup, "startup"):
            return
        container.started = True
        tasks = []
        if spec.get("readinessProbe"):
            tasks.append(self._loop(runtime, container, spec["readinessProbe"], "readiness"))
        else:
            container.ready = True
            if container.execution is not None:
                container.execution.ready = True
        if spec.get("livenessProbe"):
            tasks.append(self._loop(runtime, container, spec["livenessProbe"], "liveness"))
        await asyncio.gather(*tasks)

    async def _loop(
        self, runtime: PodRuntime, container: ContainerState, probe: dict[str, Any], kind: str
    ) -> bool:
        """Run one probe as specified. startup: returns True once it succeeded (False when it
        gave up and killed the container). readiness: drives `ready`. liveness: kills."""
        period = float(probe.get("periodSeconds", 10))
        failure_threshold = int(probe.get("failureThreshold", 3))
        success_threshold = int(probe.get("successThreshold", 1))
        await asyncio.sleep(float(probe.get("initialDelaySeconds", 0)))
        successes = failures = 0
        probed = container.process
        # The loop also ends with the process it probes: the kubelet cancels it then, but a
        # cancellation can be lost (below), and a lost one would probe the next run forever.
        while probed is not None and probed.returncode is None:
            ok = await self._check(runtime, container, probe)
            container.probe_log.append((round(time.monotonic(), 2), kind, ok))
            if ok:
                successes, failures = successes + 1, 0
            else:
                successes, failures = 0, failures + 1
            if kind == "startup":
                if ok:
                    return True
                if failures >= failure_threshold:
                    self._kill_container(container, "startup probe")
                    return False
            elif kind == "readiness":
                if successes >= success_threshold:
                    container.ready = True
                    if container.execution is not None:
                        container.execution.ready = True
                elif failures >= failure_threshold:
                    container.ready = False
            elif failures >= failure_threshold:
                self._kill_container(container, "liveness probe")
                return False
            await asyncio.sleep(period)
        return False

    def _kill_container(self, container: ContainerState, reason: str) -> None:
        container.kill_reason = reason
        kill_container(container)

    def _port(self, container: ContainerState, port: Any) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for declared in container.spec.get("ports") or []:
            if declared.get("name") == port:
                return int(declared["containerPort"])
        raise ValueError(f"probe port {port!r} is not a declared container port")

    async def _check(self, runtime: PodRuntime, container: ContainerState, probe: dict[str, Any]) -> bool:
        timeout = float(probe.get("timeoutSeconds", 1))
        try:
            if "httpGet" in probe:
                get = probe["httpGet"]
                host = get.get("host") or runtime.ip
                host = f"[{host}]" if ":" in host else host
                port = self._port(container, get["port"])
                url = f"{get.get('scheme', 'HTTP').lower()}://{host}:{port}{get.get('path', '/')}"
                headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
                async with self._session.get(
                    url, headers=headers, allow_redirects=False, timeout=aiohttp.ClientTimeout(total=timeout)
                ) as response:
                    return 200 <= response.status < 400
            if "tcpSocket" in probe:
                port = self._port(container, probe["tcpSocket"]["port"])
                host = probe["tcpSocket"].get("host") or runtime.ip
                async with asyncio.timeout(timeout):
                    _, writer = await asyncio.open_connection(host, port)
                writer.close()
                return True
            if "exec" in probe:
                assert container.process is not None
                command = [
                    "nsenter",
                    f"--target={container.process.pid}",
                    "--mount",
                    "--uts",
                    "--net",
                    "--",
                    *probe["exec"]["command"],
                ]
                process = await asyncio.create_subprocess_exec(
                    *command, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
                )
                # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancellation
                # that arrives as the command ends (as one does when a liveness probe kills the
                # container while the readiness probe's command runs), and the loop lived on.
                try:
                    async with asyncio.timeout(timeout):
                        return await process.wait() == 0
                except TimeoutError:
                    process.kill()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(5):
                            await process.wait()
                    return False
        except (OSError, TimeoutError, aiohttp.ClientError):
            return False
        except ValueError as error:
            self.problems.append(f"pod {runtime.namespace}/{runtime.name}: {error}")
            return False
        except Exception:
            # A probe that errs has failed (as the kubelet counts it); its loop goes on.
            logger.exception("probe of pod %s/%s raised", runtime.namespace, runtime.name)
            return False
        self.problems.append(f"pod {runtime.namespace}/{runtime.name}: unsupported probe {sorted(probe)}")
        return False
