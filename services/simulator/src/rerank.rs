//! `POST /v1/rerank`, answered as vLLM, Jina and Cohere-compatible servers answer it, with
//! scores a test can predict: a document's relevance is the share of the query's distinct
//! words (lowercase runs of letters and digits) that are among its own words.

use std::{collections::HashSet, time::Duration};

use axum::{
    Json,
    body::Bytes,
    extract::rejection::BytesRejection,
    response::{IntoResponse, Response},
};
use serde::Deserialize;
use serde_json::json;

use crate::{body_refused, error_response};

/// The rerank model that fails with HTTP 500.
pub(crate) const FAILING_MODEL: &str = "fail";
/// The rerank model that answers after [`SLOW_DELAY`].
pub(crate) const SLOW_MODEL: &str = "slow";
/// How long the `slow` model takes.
pub(crate) const SLOW_DELAY: Duration = Duration::from_secs(30);

#[derive(Deserialize)]
struct RerankIn {
    #[serde(default)]
    model: String,
    query: String,
    documents: Vec<DocumentIn>,
    #[serde(default)]
    top_n: Option<usize>,
}

/// A document: its text, or an object with a `text` (as Cohere's v2 API also takes).
#[derive(Deserialize)]
#[serde(untagged)]
enum DocumentIn {
    Text(String),
    Object { text: String },
}

impl DocumentIn {
    fn text(&self) -> &str {
        match self {
            Self::Text(text) | Self::Object { text } => text,
        }
    }
}

/// The distinct lowercase words of `text`.
fn words(text: &str) -> HashSet<String> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect()
}

/// The share of `query`'s words found in `document`; 0 for a query without words.
pub(crate) fn relevance(query: &HashSet<String>, document: &str) -> f64 {
    if query.is_empty() {
        return 0.0;
    }
    let document = words(document);
    let found = query.iter().filter(|w| document.contains(*w)).count();
    found as f64 / query.len() as f64
}

/// Answers a rerank request: the `top_n` best documents (all when unset), best first,
/// ties in the documents' order.
pub(crate) async fn rerank(body: Result<Bytes, BytesRejection>) -> Response {
    let body = match body {
        Ok(body) => body,
        Err(rejection) => return body_refused(&rejection),
    };
    let request: RerankIn = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(error) => {
            return error_response(400, &format!("invalid rerank request: {error}"), None);
        }
    };
    match request.model.as_str() {
        FAILING_MODEL => return error_response(500, "simulated reranker failure", None),
        SLOW_MODEL => tokio::time::sleep(SLOW_DELAY).await,
        _ => {}
    }
    let query = words(&request.query);
    let mut scored: Vec<(usize, f64)> = request
        .documents
        .iter()
        .enumerate()
        .map(|(index, document)| (index, relevance(&query, document.text())))
        .collect();
    // Stable: equal scores keep the documents' order.
    scored.sort_by(|a, b| b.1.total_cmp(&a.1));
    scored.truncate(request.top_n.unwrap_or(scored.len()));
    let results: Vec<_> = scored
        .iter()
        .map(|(index, score)| {
            json!({"index": index, "relevance_score": score,
                   "document": {"text": request.documents[*index].text()}})
        })
        .collect();
    let tokens: usize = request.query.len() / 4
        + request
            .documents
            .iter()
            .map(|d| d.text().len() / 4)
            .sum::<usize>();
    Json(json!({
        "id": "rerank-sim",
        "model": request.model,
        "results": results,
        "usage": {"total_tokens": tokens},
    }))
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relevance_is_the_share_of_query_words_found() {
        let query = words("Rust async, runtime!");
        assert_eq!(relevance(&query, "an async runtime for rust"), 1.0);
        assert!((relevance(&query, "the RUST book") - 1.0 / 3.0).abs() < 1e-9);
        assert_eq!(relevance(&query, "nothing here"), 0.0);
        assert_eq!(relevance(&words("..."), "anything"), 0.0);
    }

    #[tokio::test]
    async fn documents_come_back_best_first_cut_at_top_n() {
        let body = json!({"model": "m", "query": "red apple", "top_n": 2,
            "documents": ["a green pear", "a red apple", {"text": "red wine"}, "an apple"]});
        let response = rerank(Ok(Bytes::from(body.to_string()))).await;
        assert_eq!(response.status(), 200);
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        let answer: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        let results = answer["results"].as_array().unwrap();
        assert_eq!(results.len(), 2);
        assert_eq!(results[0]["index"], 1);
        assert_eq!(results[0]["relevance_score"], 1.0);
        // "red wine" and "an apple" tie at 0.5: the documents' order decides.
        assert_eq!(results[1]["index"], 2);
        assert_eq!(results[1]["relevance_score"], 0.5);

        let failing = json!({"model": "fail", "query": "q", "documents": ["d"]});
        let response = rerank(Ok(Bytes::from(failing.to_string()))).await;
        assert_eq!(response.status(), 500);
    }
}
