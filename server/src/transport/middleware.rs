//! The tower plumbing every HTTP middleware of the transport shares,
//! written once: a middleware says only what it does with one request
//! ([`Middleware::call`]), and [`Wrap`] turns it into a `tower::Service`
//! around the next one (readiness passed through, tower's clone-and-swap of
//! the ready inner service) and, through [`WrapLayer`], a `tower::Layer`.

#![forbid(unsafe_code)]

use std::task::{Context, Poll};

use futures_core::future::BoxFuture;
use tonic::server::NamedService;

/// Every response here has tonic's body.
pub type HttpResponse = http::Response<tonic::body::Body>;

/// What a middleware returns for one request.
pub type ResponseFuture<E> = BoxFuture<'static, Result<HttpResponse, E>>;

/// One middleware: what it does with one request before (and after) the
/// service it wraps.
pub trait Middleware<S, B>: Clone
where
    S: tower::Service<http::Request<B>, Response = HttpResponse>,
{
    /// Handles `req`. `inner` is the service `poll_ready` prepared: call it
    /// at most once, or answer without it.
    fn call(&self, inner: S, req: http::Request<B>) -> ResponseFuture<S::Error>;
}

/// A middleware around the service it wraps.
#[derive(Clone, Debug)]
pub struct Wrap<M, S> {
    middleware: M,
    inner: S,
}

impl<M, S> Wrap<M, S> {
    pub fn new(middleware: M, inner: S) -> Self {
        Wrap { middleware, inner }
    }
}

impl<M, S: NamedService> NamedService for Wrap<M, S> {
    const NAME: &'static str = S::NAME;
}

impl<M, S, B> tower::Service<http::Request<B>> for Wrap<M, S>
where
    M: Middleware<S, B>,
    S: tower::Service<http::Request<B>, Response = HttpResponse> + Clone,
{
    type Response = HttpResponse;
    type Error = S::Error;
    type Future = ResponseFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        // The instance `poll_ready` prepared goes with the request; its
        // clone stays for the next one.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        self.middleware.call(inner, req)
    }
}

/// The layer that wraps a service in a clone of `M`.
#[derive(Clone, Copy, Debug)]
pub struct WrapLayer<M>(pub M);

impl<M: Clone, S> tower::Layer<S> for WrapLayer<M> {
    type Service = Wrap<M, S>;

    fn layer(&self, inner: S) -> Self::Service {
        Wrap::new(self.0.clone(), inner)
    }
}
