"""The batch service's gRPC servicer: hands each call to the batch jobs' logic
(service.api.batch.jobs) for the caller the interceptor chain authenticated."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import (
    BatchCompletionJob,
    CancelBatchCompletionRequest,
    CancelBatchCompletionResponse,
    CreateBatchCompletionRequest,
    GetBatchCompletionRequest,
    GetBatchCompletionResponse,
    ListBatchCompletionsRequest,
    ListBatchCompletionsResponse,
    UpdateBatchCompletionRequest,
    UpdateBatchCompletionResponse,
    WatchBatchCompletionRequest,
    WatchBatchCompletionResponse,
)

from service.api.batch.jobs import BatchJobs, job_message
from service.api.batch.runner import Owner
from service.api.errors import EngineUnavailableError
from service.transport.request_context import current_record


def caller() -> Owner:
    record = current_record()
    return Owner(record.principal, record.tenant, record.key_id)


class BatchServicer(completions_pb2_grpc.BatchCompletionServiceServicer):
    def __init__(self, jobs: Callable[[], BatchJobs | None]) -> None:
        self._jobs = jobs  # None until the engine is ready

    def jobs(self) -> BatchJobs:
        jobs = self._jobs()
        if jobs is None:
            raise EngineUnavailableError("The engine is not ready; retry shortly.")
        return jobs

    async def CreateBatchCompletion(
        self, request: CreateBatchCompletionRequest, context: grpc.aio.ServicerContext
    ) -> BatchCompletionJob:
        return job_message(await self.jobs().create(request, caller()))

    async def GetBatchCompletion(
        self, request: GetBatchCompletionRequest, context: grpc.aio.ServicerContext
    ) -> GetBatchCompletionResponse:
        job = self.jobs().owned(request.batch_completion_id, caller())
        return GetBatchCompletionResponse(job=job_message(job))

    async def ListBatchCompletions(
        self, request: ListBatchCompletionsRequest, context: grpc.aio.ServicerContext
    ) -> ListBatchCompletionsResponse:
        return ListBatchCompletionsResponse(
            jobs=[job_message(job) for job in self.jobs().list(caller())]
        )

    async def UpdateBatchCompletion(
        self, request: UpdateBatchCompletionRequest, context: grpc.aio.ServicerContext
    ) -> UpdateBatchCompletionResponse:
        priority = request.priority if request.HasField("priority") else None
        job, changed = await self.jobs().update(request.batch_completion_id, priority, caller())
        reply = UpdateBatchCompletionResponse(job_id=job.job_id, status=job.status, success=changed)
        if job.priority is not None:
            reply.priority = job.priority
        return reply

    async def CancelBatchCompletion(
        self, request: CancelBatchCompletionRequest, context: grpc.aio.ServicerContext
    ) -> CancelBatchCompletionResponse:
        cancelled = await self.jobs().cancel(request.batch_completion_id, caller())
        return CancelBatchCompletionResponse(success=cancelled)

    async def WatchBatchCompletion(
        self, request: WatchBatchCompletionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[WatchBatchCompletionResponse]:
        async for job in self.jobs().watch(request.batch_completion_id, caller()):
            yield WatchBatchCompletionResponse(job=job_message(job))
