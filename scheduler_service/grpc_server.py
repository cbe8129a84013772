"""The scheduler's admin gRPC surface: SchedulerAdmin.Stats, health and reflection."""

from __future__ import annotations

from scheduler_service import convert
from servicekit.proto.pb import SCHEDULER_ADMIN_SERVICE, scheduler_pb2_grpc
from servicekit.serving import ServerLifecycle


class SchedulerAdminServicer(scheduler_pb2_grpc.SchedulerAdminServicer):
    def __init__(self, app) -> None:
        self._app = app  # scheduler_service.service.SchedulerApp

    async def Stats(self, request, context):
        return convert.stats_to_pb(self._app.stats(), consumer=self._app.settings.consumer)


def build_server(app) -> ServerLifecycle:
    lifecycle = ServerLifecycle([SCHEDULER_ADMIN_SERVICE])
    scheduler_pb2_grpc.add_SchedulerAdminServicer_to_server(SchedulerAdminServicer(app), lifecycle.server)
    return lifecycle
