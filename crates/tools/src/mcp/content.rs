//! An MCP `tools/call` result as a tool output: text content becomes the output,
//! `structuredContent` the structured output, resource links and embedded resources
//! references, and images and audio a line saying what they were. Content the SDK cannot
//! read (a type of a later protocol version) arrives as such a line too
//! ([`super::lenient`]).

use agentrt_core::Reference;
use rmcp::model::{CallToolResult, ContentBlock, ResourceContents};

use crate::{ToolOutput, truncate_text};

/// Most references one call yields; more are dropped.
const MAX_REFERENCES: usize = 100;
/// Longest snippet of an embedded text resource kept on its reference.
const MAX_SNIPPET_BYTES: usize = 1000;

/// Longest title, and longest URL, of a reference kept, in bytes.
const MAX_LABEL_BYTES: usize = 2048;

/// Cuts each reference's snippet to [`MAX_SNIPPET_BYTES`] and its title and URL to
/// [`MAX_LABEL_BYTES`], and keeps only as many as fit in `max_output_bytes` all together:
/// a link's description was kept whole, so 100 links could take an answer past the gRPC
/// message limit, which lowering the output limit did not mend.
fn bound_references(references: &mut Vec<Reference>, max_output_bytes: usize) {
    let mut total = 0;
    let mut fit = references.len();
    for (index, reference) in references.iter_mut().enumerate() {
        truncate_text(&mut reference.snippet, MAX_SNIPPET_BYTES);
        crate::cut_at(&mut reference.title, MAX_LABEL_BYTES);
        crate::cut_at(&mut reference.url, MAX_LABEL_BYTES);
        total += reference.snippet.len() + reference.title.len() + reference.url.len();
        if total > max_output_bytes {
            fit = index;
            break;
        }
    }
    references.truncate(fit);
}

/// Maps `result` of the tool offered as `tool`; the text is cut at `max_output_bytes`.
pub(crate) fn to_output(result: CallToolResult, tool: &str, max_output_bytes: usize) -> ToolOutput {
    let mut text = String::new();
    let mut references = Vec::new();
    // Past `max_output_bytes`, text is no longer kept; the references of later blocks
    // still are (they have a budget of their own).
    let push = |line: &str, text: &mut String| {
        if text.len() > max_output_bytes {
            return;
        }
        if !text.is_empty() {
            text.push('\n');
        }
        text.push_str(line);
    };
    for block in result.content {
        if text.len() > max_output_bytes && references.len() >= MAX_REFERENCES {
            break;
        }
        match block {
            ContentBlock::Text(t) => push(&t.text, &mut text),
            ContentBlock::Image(image) => push(
                &format!(
                    "[image: {}, {} bytes]",
                    image.mime_type,
                    decoded_len(&image.data)
                ),
                &mut text,
            ),
            ContentBlock::Audio(audio) => push(
                &format!(
                    "[audio: {}, {} bytes]",
                    audio.mime_type,
                    decoded_len(&audio.data)
                ),
                &mut text,
            ),
            ContentBlock::ResourceLink(link) => {
                let title = link.title.clone().unwrap_or_else(|| link.name.clone());
                push(
                    &format!("[resource link: {title} <{}>]", link.uri),
                    &mut text,
                );
                references.push(Reference {
                    title,
                    url: link.uri,
                    snippet: link.description.unwrap_or_default(),
                    score: 0.0,
                    source: tool.to_owned(),
                });
            }
            ContentBlock::Resource(embedded) => match embedded.resource {
                ResourceContents::TextResourceContents {
                    uri, text: body, ..
                } => {
                    let mut snippet = body.clone();
                    truncate_text(&mut snippet, MAX_SNIPPET_BYTES);
                    push(&body, &mut text);
                    references.push(Reference {
                        title: uri.clone(),
                        url: uri,
                        snippet,
                        score: 0.0,
                        source: tool.to_owned(),
                    });
                }
                ResourceContents::BlobResourceContents {
                    uri,
                    mime_type,
                    blob,
                    ..
                } => {
                    push(
                        &format!(
                            "[resource: {uri}, {}, {} bytes]",
                            mime_type.as_deref().unwrap_or("application/octet-stream"),
                            decoded_len(&blob)
                        ),
                        &mut text,
                    );
                    references.push(Reference {
                        title: uri.clone(),
                        url: uri,
                        snippet: String::new(),
                        score: 0.0,
                        source: tool.to_owned(),
                    });
                }
                _ => push("[resource of an unknown kind]", &mut text),
            },
            _ => push("[content of an unknown kind]", &mut text),
        }
    }
    references.truncate(MAX_REFERENCES);
    bound_references(&mut references, max_output_bytes);
    let mut structured = result.structured_content;
    if let Some(value) = &structured {
        let json = value.to_string();
        // Bound as the text is: a structured output past `max_output_bytes` is left out
        // (the text, cut, says what it held).
        if json.len() > max_output_bytes {
            structured = None;
        }
        if text.is_empty() {
            text = json;
        }
    }
    truncate_text(&mut text, max_output_bytes);
    ToolOutput {
        text,
        structured,
        references,
        is_error: result.is_error.unwrap_or(false),
        timed_out: false,
        stopped: false,
    }
}

/// The size of base64 `data` once decoded.
fn decoded_len(data: &str) -> usize {
    let padding = data.bytes().rev().take_while(|b| *b == b'=').count();
    (data.len() / 4 * 3 + data.len() % 4 * 3 / 4).saturating_sub(padding)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn result(value: serde_json::Value) -> CallToolResult {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn every_kind_of_content_is_mapped() {
        let out = to_output(
            result(json!({
                "content": [
                    {"type": "text", "text": "hello"},
                    {"type": "image", "data": "iVBORw0KGgo=", "mimeType": "image/png"},
                    {"type": "resource_link", "uri": "test://a", "name": "A", "description": "first"},
                    {"type": "resource", "resource": {"uri": "test://b", "mimeType": "text/plain", "text": "body of b"}},
                    {"type": "resource", "resource": {"uri": "test://c", "blob": "AAAA"}}
                ],
                "structuredContent": {"n": 1},
                "isError": true
            })),
            "ev__tool",
            1 << 20,
        );
        assert_eq!(
            out.text,
            "hello\n[image: image/png, 8 bytes]\n[resource link: A <test://a>]\nbody of b\n\
             [resource: test://c, application/octet-stream, 3 bytes]"
        );
        assert_eq!(out.structured, Some(json!({"n": 1})));
        assert!(out.is_error);
        let urls: Vec<_> = out.references.iter().map(|r| r.url.as_str()).collect();
        assert_eq!(urls, ["test://a", "test://b", "test://c"]);
        assert_eq!(out.references[0].snippet, "first");
        assert_eq!(out.references[1].snippet, "body of b");
        assert_eq!(out.references[0].source, "ev__tool");
    }

    /// References are bounded as the text is: each link's description is a snippet,
    /// cut, and only as many as fit in the output limit are kept.
    #[test]
    fn references_are_bounded_by_the_output_limit() {
        let links: Vec<_> = (0..100)
            .map(|i| {
                json!({"type": "resource_link", "uri": format!("test://{i}/{}", "u".repeat(5000)),
                       "name": "n".repeat(5000), "description": "d".repeat(100_000)})
            })
            .collect();
        let out = to_output(result(json!({"content": links})), "t", 64 * 1024);
        let total: usize = out
            .references
            .iter()
            .map(|r| r.snippet.len() + r.title.len() + r.url.len())
            .sum();
        assert!(total <= 64 * 1024, "{total}");
        assert!(!out.references.is_empty());
        for reference in &out.references {
            assert!(reference.snippet.len() <= MAX_SNIPPET_BYTES + 64);
            assert_eq!(reference.title.len(), MAX_LABEL_BYTES);
            assert_eq!(reference.url.len(), MAX_LABEL_BYTES);
        }
    }

    #[test]
    fn links_after_text_past_the_bound_are_still_references() {
        let out = to_output(
            result(json!({
                "content": [
                    {"type": "text", "text": "A".repeat(2000)},
                    {"type": "resource_link", "uri": "https://example.com/x", "name": "x"},
                    {"type": "resource", "resource": {"uri": "file:///y", "text": "why"}},
                ],
            })),
            "t",
            1024,
        );
        assert!(
            out.text.ends_with("A\n[output truncated at 1024 bytes]"),
            "{}",
            out.text
        );
        let urls: Vec<&str> = out.references.iter().map(|r| r.url.as_str()).collect();
        assert_eq!(urls, ["https://example.com/x", "file:///y"]);
    }

    #[test]
    fn structured_output_past_the_bound_is_left_out() {
        let big = json!({"t": "x".repeat(2000)});
        let out = to_output(
            result(json!({"content": [{"type": "text", "text": "big"}], "structuredContent": big})),
            "t",
            1024,
        );
        assert_eq!(out.structured, None);
        assert_eq!(out.text, "big");
        let out = to_output(
            result(json!({"content": [], "structuredContent": big})),
            "t",
            1024,
        );
        assert_eq!(out.structured, None);
        assert!(
            out.text.ends_with("[output truncated at 1024 bytes]"),
            "{}",
            out.text
        );
    }

    #[test]
    fn structured_only_results_read_as_json_and_long_text_is_cut() {
        let out = to_output(
            result(json!({"content": [], "structuredContent": {"t": 20}})),
            "x",
            1024,
        );
        assert_eq!(out.text, r#"{"t":20}"#);
        let out = to_output(
            result(json!({"content": [{"type": "text", "text": "x".repeat(5000)}]})),
            "x",
            1024,
        );
        assert!(out.text.len() < 1100);
        assert!(out.text.ends_with("[output truncated at 1024 bytes]"));
    }
}
