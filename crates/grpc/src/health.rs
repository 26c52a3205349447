//! `grpc.health.v1.Health` as the health checking protocol has it: tonic-health's service,
//! with `Watch` of a service the server does not report answered `SERVICE_UNKNOWN` on a
//! call that stays open (tonic-health ends it `NOT_FOUND`, which Watch-based clients read
//! as a failed call, not as a status).

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use tokio_stream::Stream;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tonic::{Code, Request, Response, Status};
use tonic_health::{
    pb::{
        HealthCheckRequest, HealthCheckResponse,
        health_check_response::ServingStatus,
        health_server::{Health, HealthServer},
    },
    server::{HealthReporter, HealthService},
};

/// The health service of the statuses `reporter` sets. A `Watch` ends when `stop` is
/// cancelled (the drain): one of a known service after `NOT_SERVING`, so that a client's
/// open `Watch` does not hold the drain for its whole grace; one of an unknown service
/// stays open until then (the services a server reports are known from its start, so none
/// becomes known later).
pub(crate) fn service(reporter: HealthReporter, stop: CancellationToken) -> HealthServer<Watched> {
    HealthServer::new(Watched {
        inner: HealthService::from_health_reporter(reporter),
        stop,
    })
    // A request names a service: a few bytes. Calls need no token, so the default limit
    // (4 MiB) would let anyone make the server hold that much per call in flight.
    .max_decoding_message_size(MAX_REQUEST_BYTES)
}

/// Largest health request accepted, in bytes.
const MAX_REQUEST_BYTES: usize = 1024;

/// See [`service`].
pub(crate) struct Watched {
    inner: HealthService,
    stop: CancellationToken,
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Health for Watched {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        self.inner.check(request).await
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<WatchStream>, Status> {
        match self.inner.watch(request).await {
            Ok(statuses) => Ok(Response::new(Box::pin(UntilDrain {
                statuses: Box::pin(statuses.into_inner()),
                stop: Box::pin(self.stop.clone().cancelled_owned()),
                ended: false,
            }))),
            Err(status) if status.code() == Code::NotFound => {
                Ok(Response::new(Box::pin(Unknown {
                    told: false,
                    stop: Box::pin(self.stop.clone().cancelled_owned()),
                })))
            }
            Err(status) => Err(status),
        }
    }
}

/// The `Watch` of an unknown service: `SERVICE_UNKNOWN`, then nothing until the server stops.
struct Unknown {
    told: bool,
    stop: Pin<Box<WaitForCancellationFutureOwned>>,
}

impl Stream for Unknown {
    type Item = Result<HealthCheckResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if !self.told {
            self.told = true;
            return Poll::Ready(Some(Ok(HealthCheckResponse {
                status: ServingStatus::ServiceUnknown.into(),
            })));
        }
        self.stop.as_mut().poll(cx).map(|()| None)
    }
}

/// The `Watch` of a known service: its statuses, then `NOT_SERVING` and the end once the
/// server drains.
struct UntilDrain {
    statuses: WatchStream,
    stop: Pin<Box<WaitForCancellationFutureOwned>>,
    ended: bool,
}

impl Stream for UntilDrain {
    type Item = Result<HealthCheckResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.ended {
            return Poll::Ready(None);
        }
        if let Poll::Ready(status) = self.statuses.as_mut().poll_next(cx) {
            return Poll::Ready(status);
        }
        if self.stop.as_mut().poll(cx).is_ready() {
            self.ended = true;
            return Poll::Ready(Some(Ok(HealthCheckResponse {
                status: ServingStatus::NotServing.into(),
            })));
        }
        Poll::Pending
    }
}
