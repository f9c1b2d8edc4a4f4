"""A Spark DataFrame of a pyarrow Table, made the same way on every supported Spark line: the
rows through Python under the table's own schema. (Spark 3.5's ``createDataFrame`` takes no
Arrow table, and its pandas path mishandles pandas 3's datetimes and array columns.)"""

from __future__ import annotations


def frame(spark, table):
    """``table`` (a pyarrow Table) as a DataFrame of the same columns, types and rows."""
    from pyspark.sql.pandas.types import from_arrow_schema

    return spark.createDataFrame(table.to_pylist(maps_as_pydicts="strict"), schema=from_arrow_schema(table.schema))
