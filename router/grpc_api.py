"""The public gRPC API, tpserve.v1.Generation: a thin servicer over the Frontend.

A RequestFailed becomes the call's status here and nowhere else: INVALID_ARGUMENT also carries a
google.rpc.BadRequest detail naming the field, for clients that read rich error details.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from common import tracing
from common.pb.tpserve.v1 import generation_pb2, generation_pb2_grpc
from router.auth import CALLER_AUTHORIZATION
from router.frontend import Frontend, RequestFailed


def rich_status(e: RequestFailed) -> grpc.Status:
    status = status_pb2.Status(code=e.code.value[0], message=e.message)
    if e.code == grpc.StatusCode.INVALID_ARGUMENT and e.field:
        violation = error_details_pb2.BadRequest.FieldViolation(field=e.field, description=e.message)
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.BadRequest(field_violations=[violation]))
        status.details.append(detail)
    return rpc_status.to_status(status)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, frontend: Frontend):
        self.frontend = frontend

    async def Generate(self, request, context):
        metadata = context.invocation_metadata() or ()
        parent = tracing.context_from_metadata(metadata)
        CALLER_AUTHORIZATION.set(
            tuple((k, str(v)) for k, v in metadata if k in ("authorization", "x-api-key"))
        )
        try:
            async for resp in self.frontend.generate(request, parent):
                yield resp
        except RequestFailed as e:
            await context.abort_with_status(rich_status(e))

    async def GetModelInfo(self, request, context):
        try:
            return self.frontend.model_info()
        except RequestFailed as e:
            await context.abort_with_status(rich_status(e))

    async def GetStats(self, request, context):
        try:
            return await self.frontend.stats()
        except RequestFailed as e:
            await context.abort_with_status(rich_status(e))

    async def LoadLoRAAdapter(self, request, context):
        try:
            await self.frontend.loras.load(request.lora_name, request.lora_path)
        except RequestFailed as e:
            await context.abort_with_status(rich_status(e))
        return generation_pb2.LoadLoRAAdapterResponse()

    async def UnloadLoRAAdapter(self, request, context):
        try:
            finishing = await self.frontend.loras.unload(request.lora_name)
        except RequestFailed as e:
            await context.abort_with_status(rich_status(e))
        return generation_pb2.UnloadLoRAAdapterResponse(requests_finishing=finishing)
