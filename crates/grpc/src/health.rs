//! `grpc.health.v1.Health` as the health checking protocol has it: tonic-health's service,
//! with `Watch` of a service the server does not report answered `SERVICE_UNKNOWN` on a
//! call that stays open (tonic-health ends it `NOT_FOUND`, which Watch-based clients read
//! as a failed call, not as a status).

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
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
        watches: Arc::new(Semaphore::new(MAX_WATCHES)),
    })
    // A request names a service: a few bytes. Calls need no token, so the default limit
    // (4 MiB) would let anyone make the server hold that much per call in flight.
    .max_decoding_message_size(MAX_REQUEST_BYTES)
}

/// Largest health request accepted, in bytes.
const MAX_REQUEST_BYTES: usize = 1024;

/// Most `Watch` calls open at once, all ports of the server together. Health needs no
/// token, and a `Watch` stays open until the drain: unbounded, anyone could make the
/// server hold streams without end. Probes call `Check`, which this does not bound.
const MAX_WATCHES: usize = 1024;

/// See [`service`].
pub(crate) struct Watched {
    inner: HealthService,
    stop: CancellationToken,
    /// A permit per open `Watch`.
    watches: Arc<Semaphore>,
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
        let Ok(permit) = self.watches.clone().try_acquire_owned() else {
            return Err(crate::status::resource_exhausted(
                "TOO_MANY_WATCHES",
                format!(
                    "{MAX_WATCHES} health Watch calls are open on this server, the most it \
                     keeps; call Check, or Watch again later"
                ),
                Duration::from_secs(5),
            ));
        };
        match self.inner.watch(request).await {
            Ok(statuses) => Ok(Response::new(Box::pin(UntilDrain {
                statuses: Box::pin(statuses.into_inner()),
                stop: Box::pin(self.stop.clone().cancelled_owned()),
                ended: false,
                _permit: permit,
            }))),
            Err(status) if status.code() == Code::NotFound => {
                Ok(Response::new(Box::pin(Unknown {
                    told: false,
                    stop: Box::pin(self.stop.clone().cancelled_owned()),
                    _permit: permit,
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
    /// Its place among the open `Watch` calls.
    _permit: OwnedSemaphorePermit,
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
    /// Its place among the open `Watch` calls.
    _permit: OwnedSemaphorePermit,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A `Watch` past the bound is refused at once, `RESOURCE_EXHAUSTED` with a RetryInfo;
    /// one ended makes room.
    #[tokio::test]
    async fn watches_are_bounded() {
        let (reporter, _) = tonic_health::server::health_reporter();
        let watched = Watched {
            inner: HealthService::from_health_reporter(reporter),
            stop: CancellationToken::new(),
            watches: Arc::new(Semaphore::new(MAX_WATCHES)),
        };
        let watch = |service: &str| {
            watched.watch(Request::new(HealthCheckRequest {
                service: service.into(),
            }))
        };
        let mut open = Vec::new();
        for n in 0..MAX_WATCHES {
            // Known services and unknown ones alike.
            let service = if n % 2 == 0 { "" } else { "nope" };
            open.push(watch(service).await.unwrap());
        }
        let refused = watch("nope").await.err().expect("past the bound");
        assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
        let details = tonic_types::StatusExt::get_error_details(&refused);
        assert_eq!(details.error_info().unwrap().reason, "TOO_MANY_WATCHES");
        assert!(details.retry_info().is_some());
        drop(open.pop());
        watch("").await.unwrap();
    }
}
