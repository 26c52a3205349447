//! Conversions between `google.protobuf.Struct`/`Value` and `serde_json::Value`.
//!
//! Tools and configs speak JSON inside the services; the wire speaks `Struct`. These
//! conversions are the one place where the two meet.

use prost_types::{ListValue, Struct, Value, value::Kind};
use serde_json::{Map, Number};

/// Converts a protobuf `Value` into JSON. A number that is not finite (which JSON cannot
/// hold) becomes `null`, as the protobuf JSON mapping does.
pub fn value_to_json(value: &Value) -> serde_json::Value {
    match &value.kind {
        None | Some(Kind::NullValue(_)) => serde_json::Value::Null,
        Some(Kind::BoolValue(b)) => serde_json::Value::Bool(*b),
        Some(Kind::NumberValue(n)) => number_to_json(*n),
        Some(Kind::StringValue(s)) => serde_json::Value::String(s.clone()),
        Some(Kind::ListValue(list)) => {
            serde_json::Value::Array(list.values.iter().map(value_to_json).collect())
        }
        Some(Kind::StructValue(s)) => serde_json::Value::Object(struct_to_map(s)),
    }
}

/// Converts a protobuf `Struct` into a JSON object.
pub fn struct_to_json(s: &Struct) -> serde_json::Value {
    serde_json::Value::Object(struct_to_map(s))
}

fn struct_to_map(s: &Struct) -> Map<String, serde_json::Value> {
    s.fields
        .iter()
        .map(|(k, v)| (k.clone(), value_to_json(v)))
        .collect()
}

/// Integral values come back as JSON integers, so that `{"n": 3}` survives a round trip
/// through `Struct` (which stores every number as a double) as `3`, not `3.0`.
fn number_to_json(n: f64) -> serde_json::Value {
    const MAX_EXACT: f64 = 9_007_199_254_740_992.0; // 2^53: every integer below is exact
    if n.fract() == 0.0 && n.abs() < MAX_EXACT {
        // The guard above makes the cast exact.
        #[allow(clippy::cast_possible_truncation)]
        return serde_json::Value::Number(Number::from(n as i64));
    }
    Number::from_f64(n).map_or(serde_json::Value::Null, serde_json::Value::Number)
}

/// Converts JSON into a protobuf `Value`. Integers beyond 2^53 lose precision, as they
/// would in any JSON parser that uses doubles.
pub fn json_to_value(json: &serde_json::Value) -> Value {
    let kind = match json {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(*b),
        serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(f64::NAN)),
        serde_json::Value::String(s) => Kind::StringValue(s.clone()),
        serde_json::Value::Array(items) => Kind::ListValue(ListValue {
            values: items.iter().map(json_to_value).collect(),
        }),
        serde_json::Value::Object(map) => Kind::StructValue(map_to_struct(map)),
    };
    Value { kind: Some(kind) }
}

/// Converts a JSON value into a protobuf `Struct`; `None` unless it is an object.
pub fn json_to_struct(json: &serde_json::Value) -> Option<Struct> {
    json.as_object().map(map_to_struct)
}

fn map_to_struct(map: &Map<String, serde_json::Value>) -> Struct {
    Struct {
        fields: map
            .iter()
            .map(|(k, v)| (k.clone(), json_to_value(v)))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn round_trip_keeps_integers_and_nesting() {
        let original = json!({
            "n": 3, "x": 2.5, "neg": -7, "s": "hi", "b": true, "z": null,
            "list": [1, "two", {"three": 3}], "obj": {"inner": [false]}
        });
        let back = struct_to_json(&json_to_struct(&original).unwrap());
        assert_eq!(back, original);
    }

    #[test]
    fn non_objects_are_not_structs() {
        assert!(json_to_struct(&json!([1, 2])).is_none());
        assert!(json_to_struct(&json!("s")).is_none());
    }

    #[test]
    fn non_finite_numbers_become_null() {
        let v = Value {
            kind: Some(Kind::NumberValue(f64::INFINITY)),
        };
        assert_eq!(value_to_json(&v), serde_json::Value::Null);
    }
}
