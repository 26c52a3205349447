//! Reranking documents against a query through a provider's `/rerank` endpoint, in the
//! shape vLLM, Jina and Cohere-compatible servers share.

use std::time::Duration;

use futures_util::StreamExt as _;
use http::header::HeaderMap;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::{
    ModelError, ProviderSettings,
    openai::{ResponseLimits, Site, error_chain, general_client, http_error, read_bounded},
};

/// Default bound of one rerank call, the answer read included.
pub const RERANK_TIMEOUT: Duration = Duration::from_secs(10);
/// Default bound of a rerank answer's body, in bytes.
pub const MAX_RERANK_RESPONSE_BYTES: usize = 1024 * 1024;

/// One rerank call: which of `documents` answer `query` best.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RerankRequest {
    /// The provider's rerank model.
    pub model: String,
    /// What the documents are ranked against (the run's query).
    pub query: String,
    /// The texts ranked (a reference's snippet, or its title when that is empty).
    pub documents: Vec<String>,
    /// How many of the best to return; `None` returns them all.
    pub top_n: Option<usize>,
}

/// One ranked document.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RerankResult {
    /// Its position in [`RerankRequest::documents`].
    pub index: usize,
    /// How relevant the provider found it; higher is better (often between 0 and 1).
    pub relevance_score: f64,
}

/// Ranks documents against a query. A failure is an error the caller reports beside the
/// documents in their original order; it never fails a run.
#[async_trait::async_trait]
pub trait Reranker: Send + Sync {
    /// The best documents, best first (ties in the documents' order), at most `top_n`.
    /// `cancel` ends the call at any point with [`ModelError::Cancelled`].
    async fn rerank(
        &self,
        request: RerankRequest,
        cancel: CancellationToken,
    ) -> Result<Vec<RerankResult>, ModelError>;
}

/// `POST {base_url}/rerank` of an OpenAI-compatible provider (vLLM, Jina, Cohere-compatible
/// servers, the simulator), bounded by a timeout and by the size of its answer, following
/// no redirects.
#[derive(Clone)]
pub struct HttpReranker {
    http: reqwest::Client,
    url: reqwest::Url,
    headers: HeaderMap,
    site: Site,
    timeout: Duration,
    max_response_bytes: usize,
}

impl HttpReranker {
    /// A reranker of the provider `settings` describes, with [`RERANK_TIMEOUT`] and
    /// [`MAX_RERANK_RESPONSE_BYTES`].
    pub fn new(settings: &ProviderSettings) -> Result<Self, ModelError> {
        let url = crate::providers::endpoint(&settings.base_url, "rerank");
        let site = Site::new(&url);
        let url = reqwest::Url::parse(&url)
            .map_err(|e| ModelError::Connect(format!("invalid base URL {:?}: {e}", site.url())))?;
        let headers = crate::openai::request_headers(settings, "application/json")?;
        Ok(Self {
            http: general_client(settings.http2_prior_knowledge)?,
            url,
            headers,
            site,
            timeout: RERANK_TIMEOUT,
            max_response_bytes: MAX_RERANK_RESPONSE_BYTES,
        })
    }

    /// Names the reranker after its provider, which its errors then give.
    #[must_use]
    pub fn with_name(mut self, provider: impl Into<String>) -> Self {
        self.site.set_provider(provider.into());
        self
    }

    /// Sets the bound of one call.
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets the bound of an answer's body, in bytes.
    #[must_use]
    pub fn with_max_response_bytes(mut self, bytes: usize) -> Self {
        self.max_response_bytes = bytes;
        self
    }

    async fn call(&self, request: &RerankRequest) -> Result<Vec<RerankResult>, ModelError> {
        let body = serde_json::to_vec(&WireRequest {
            model: &request.model,
            query: &request.query,
            documents: &request.documents,
            top_n: request.top_n,
        })
        .map_err(|e| ModelError::InvalidResponse(format!("cannot write the request: {e}")))?;
        let response = self
            .http
            .post(self.url.clone())
            .headers(self.headers.clone())
            .body(body)
            .send()
            .await
            .map_err(|e| {
                debug!(url = %self.site.url(), error = %error_chain(&e), "rerank call failed");
                ModelError::Connect(format!(
                    "{}: {}",
                    self.site.who(),
                    error_chain(&e.without_url())
                ))
            })?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let mut body = http_body_util::BodyDataStream::new(reqwest::Body::from(response));
        if !(200..300).contains(&status) {
            let limits = ResponseLimits::default();
            return Err(http_error(status, &headers, &mut body, &self.site, &limits).await);
        }
        let (text, cut) = read_bounded(body.by_ref(), self.max_response_bytes).await;
        if cut {
            return Err(ModelError::TooLarge {
                what: "the rerank answer",
                limit: self.max_response_bytes,
            });
        }
        let answer: WireAnswer = serde_json::from_str(&text).map_err(|e| {
            let shown: String = text.trim().chars().take(300).collect();
            ModelError::InvalidResponse(format!(
                "{} answered POST {} with something other than rerank results ({e}): {shown}",
                self.site.who(),
                self.site.path()
            ))
        })?;
        let mut results = Vec::with_capacity(answer.results.len());
        for result in answer.results {
            if result.index >= request.documents.len() || !result.relevance_score.is_finite() {
                return Err(ModelError::InvalidResponse(format!(
                    "{} ranked document {} with score {} among {} documents",
                    self.site.who(),
                    result.index,
                    result.relevance_score,
                    request.documents.len()
                )));
            }
            results.push(RerankResult {
                index: result.index,
                relevance_score: result.relevance_score,
            });
        }
        // Best first whatever the server's order; stable, so ties keep the server's.
        results.sort_by(|a, b| b.relevance_score.total_cmp(&a.relevance_score));
        let mut seen = vec![false; request.documents.len()];
        results.retain(|r| !std::mem::replace(&mut seen[r.index], true));
        if let Some(top_n) = request.top_n {
            results.truncate(top_n);
        }
        Ok(results)
    }
}

#[async_trait::async_trait]
impl Reranker for HttpReranker {
    async fn rerank(
        &self,
        request: RerankRequest,
        cancel: CancellationToken,
    ) -> Result<Vec<RerankResult>, ModelError> {
        tokio::select! {
            outcome = tokio::time::timeout(self.timeout, self.call(&request)) => {
                outcome.map_err(|_| ModelError::Timeout(self.timeout))?
            }
            () = cancel.cancelled() => Err(ModelError::Cancelled),
        }
    }
}

#[derive(serde::Serialize)]
struct WireRequest<'a> {
    model: &'a str,
    query: &'a str,
    documents: &'a [String],
    #[serde(skip_serializing_if = "Option::is_none")]
    top_n: Option<usize>,
}

#[derive(serde::Deserialize)]
struct WireAnswer {
    results: Vec<WireResult>,
}

#[derive(serde::Deserialize)]
struct WireResult {
    index: usize,
    relevance_score: f64,
}
