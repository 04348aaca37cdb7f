//! The spec's schema for OpenAPI documents (feature `openapi`), where deriving it cannot say what the spec
//! accepts: quantities given as numbers or strings (`cpus = "500m"`, `memory = "2GiB"`), and a model given by its
//! name or as a table. The other types derive `utoipa::ToSchema` where they are defined.

use std::borrow::Cow;

use utoipa::openapi::RefOr;
use utoipa::openapi::schema::{AnyOfBuilder, ObjectBuilder, Schema, Type};
use utoipa::{PartialSchema, ToSchema};

use crate::{ModelKind, ModelSpec, ModelTable};

/// CPUs or GPUs: a number (`2`, `0.5`) or a string, thousandths with `m` (`"500m"`) or a number (`"1.5"`).
pub(crate) struct Quantity;

impl PartialSchema for Quantity {
    fn schema() -> RefOr<Schema> {
        AnyOfBuilder::new()
            .item(ObjectBuilder::new().schema_type(Type::Number).minimum(Some(0.0)))
            .item(ObjectBuilder::new().schema_type(Type::String).pattern(Some(r"^\s*([0-9]+m|[0-9]+(\.[0-9]+)?)\s*$")))
            .description(Some("A number (2, 0.5) or a string: \"500m\" (thousandths), \"1.5\""))
            .into()
    }
}

impl ToSchema for Quantity {}

/// Bytes: an integer, or a string with a unit (`"2GiB"`, `"512MiB"`, `"1.5GB"`).
pub(crate) struct Bytes;

impl PartialSchema for Bytes {
    fn schema() -> RefOr<Schema> {
        AnyOfBuilder::new()
            .item(ObjectBuilder::new().schema_type(Type::Integer).minimum(Some(0.0)))
            .item(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .pattern(Some(r"^\s*[0-9]+(\.[0-9]+)?\s*([KMGT]i?B|B)?\s*$")),
            )
            .description(Some("Bytes: an integer, or a string with a unit (KiB MiB GiB TiB, KB MB GB TB)"))
            .into()
    }
}

impl ToSchema for Bytes {}

/// The name of a built-in dataset: one of the catalogue's, read from it.
pub(crate) struct DatasetName;

impl PartialSchema for DatasetName {
    fn schema() -> RefOr<Schema> {
        let names: Vec<String> = crate::data::catalogue().into_iter().map(|d| d.name).collect();
        ObjectBuilder::new()
            .schema_type(Type::String)
            .enum_values(Some(names))
            .description(Some("A built-in dataset (`shoal datasets`)"))
            .into()
    }
}

impl ToSchema for DatasetName {}

impl PartialSchema for ModelSpec {
    fn schema() -> RefOr<Schema> {
        AnyOfBuilder::new()
            .item(ModelKind::schema())
            .item(ModelTable::schema())
            .description(Some("A model's name (\"mlp\", \"cnn\", \"gpt\"), or a table with `kind` and sizes"))
            .into()
    }
}

impl ToSchema for ModelSpec {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("ModelSpec")
    }

    fn schemas(schemas: &mut Vec<(String, RefOr<Schema>)>) {
        <ModelKind as ToSchema>::schemas(schemas);
        <ModelTable as ToSchema>::schemas(schemas);
    }
}
