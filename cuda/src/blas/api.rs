// Types shared by the real cuBLAS module and its dummy: how a row-major product maps onto
// cuBLAS's column-major arguments. Plain host arithmetic, unit-tested in every build.
//
// **Row-major to column-major.** regflow's tensors are row-major; cuBLAS reads matrices
// column-major. A row-major `r x c` matrix with row stride `ld` is, byte for byte, the
// column-major `c x r` matrix (its transpose) with leading dimension `ld`. So a row-major
// product `C = A·B` is computed as the column-major `Cᵀ = Bᵀ·Aᵀ`: cuBLAS's first operand
// is regflow's `b`, its second `a`, its `m` is regflow's `n` and its `n` regflow's `m`;
// no element is copied. A transposed operand (`transpose_a`) or a permuted one
// (`permuted_matmul`, whose matrices may be stored column-major) only changes which
// `cublasOperation_t` flag and leading dimension it gets. When the output itself is stored
// column-major (a permuted output whose row stride is 1) the product is computed directly
// as `C = A·B`.

/// A matrix as regflow reads it: `rows x cols` elements, element `(i, j)` at
/// `i * row_stride + j * col_stride` from its base (in elements).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatrixLayout {
    /// Rows of the logical matrix (`op(x)` for a transposed operand).
    pub rows: usize,
    /// Columns of the logical matrix.
    pub cols: usize,
    /// Elements between consecutive rows.
    pub row_stride: usize,
    /// Elements between consecutive columns.
    pub col_stride: usize,
}

impl MatrixLayout {
    /// The logical `rows x cols` matrix `op(x)` of a dense row-major `x`: `x` itself, or,
    /// if `transposed`, the transpose of a stored `cols x rows` matrix.
    pub fn row_major(rows: usize, cols: usize, transposed: bool) -> Self {
        if transposed {
            Self { rows, cols, row_stride: 1, col_stride: rows }
        } else {
            Self { rows, cols, row_stride: cols, col_stride: 1 }
        }
    }

    /// How the memory holds this matrix for cuBLAS: `(stored_transposed, ld)`, where the
    /// memory is the column-major matrix `Xᵀ` (`stored_transposed`, i.e. `X` is row-major)
    /// or `X`, with leading dimension `ld`; `None` when neither stride is 1 (cuBLAS needs a
    /// unit stride along one axis). A stride along an axis of one element is never read, so
    /// it is chosen freely (cuBLAS still wants `ld >= max(1, stored rows)`).
    pub fn column_major(&self) -> Option<(bool, usize)> {
        let (row_free, col_free) = (self.rows <= 1, self.cols <= 1);
        // The memory as `Xᵀ` column-major: unit column stride, ld the row stride.
        if self.col_stride == 1 || col_free {
            let ld = if row_free { self.cols.max(1) } else { self.row_stride };
            if ld >= self.cols.max(1) {
                return Some((true, ld));
            }
        }
        // The memory as `X` column-major: unit row stride, ld the column stride.
        if self.row_stride == 1 || row_free {
            let ld = if col_free { self.rows.max(1) } else { self.col_stride };
            if ld >= self.rows.max(1) {
                return Some((false, ld));
            }
        }
        None
    }
}

/// One strided-batched GEMM as cuBLAS takes it: `C_i = alpha · op(A_i)·op(B_i) + beta · C_i`
/// for `i < batch`, column-major. Built on the host from regflow's row-major description by
/// [`Gemm::plan`]; `swapped` says that cuBLAS's `A` is regflow's `b` (and `B` is `a`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gemm {
    /// Whether cuBLAS's `A` is regflow's `b` (the row-major output case, `Cᵀ = Bᵀ·Aᵀ`).
    pub swapped: bool,
    /// `CUBLAS_OP_T` (true) or `CUBLAS_OP_N` for cuBLAS's `A`.
    pub transa: bool,
    /// As `transa`, for cuBLAS's `B`.
    pub transb: bool,
    /// Rows of cuBLAS's `op(A)` and `C`.
    pub m: i32,
    /// Columns of cuBLAS's `op(B)` and `C`.
    pub n: i32,
    /// The inner dimension.
    pub k: i32,
    /// Leading dimension of cuBLAS's `A`.
    pub lda: i32,
    /// Leading dimension of cuBLAS's `B`.
    pub ldb: i32,
    /// Leading dimension of `C`.
    pub ldc: i32,
    /// Elements between batch elements of cuBLAS's `A` (0: shared).
    pub stride_a: i64,
    /// Elements between batch elements of cuBLAS's `B` (0: shared).
    pub stride_b: i64,
    /// Elements between batch elements of `C`.
    pub stride_c: i64,
    /// Products in the batch.
    pub batch: i32,
}

/// A value as cuBLAS's `int`, or an error naming it.
fn int(what: &str, v: usize) -> Result<i32, String> {
    i32::try_from(v).map_err(|_| format!("{what} = {v} exceeds cuBLAS's 32-bit int"))
}

/// A batch step as cuBLAS's `long long`, or an error naming it.
fn long(what: &str, v: usize) -> Result<i64, String> {
    i64::try_from(v).map_err(|_| format!("{what} = {v} exceeds cuBLAS's 64-bit stride"))
}

impl Gemm {
    /// The argument rules cuBLAS checks (`CUBLAS_STATUS_INVALID_VALUE` otherwise): sizes
    /// and the batch not negative, each leading dimension at least the rows of its stored
    /// (column-major) matrix and at least 1, strides not negative. Checked before every
    /// product, and all a dry run does.
    pub fn check(&self) -> Result<(), String> {
        let (m, n, k) = (self.m, self.n, self.k);
        if m < 0 || n < 0 || k < 0 || self.batch < 0 {
            return Err(format!("negative size: m {m}, n {n}, k {k}, batch {}", self.batch));
        }
        // Stored rows of A: m (op N) or k (op T); of B: k or n; of C: m.
        let a_rows = if self.transa { k } else { m };
        let b_rows = if self.transb { n } else { k };
        for (what, ld, rows) in [("lda", self.lda, a_rows), ("ldb", self.ldb, b_rows), ("ldc", self.ldc, m)] {
            if ld < rows.max(1) {
                return Err(format!("{what} = {ld} is less than max(1, {rows}), the rows of its matrix ({self:?})"));
            }
        }
        if self.stride_a < 0 || self.stride_b < 0 || self.stride_c < 0 {
            return Err(format!("a negative batch stride ({self:?})"));
        }
        Ok(())
    }

    /// The cuBLAS arguments computing, for `i < batch`, the row-major product
    /// `c_i = a_i · b_i` where `a_i` (`m x k`), `b_i` (`k x n`) and `c_i` (`m x n`) are read
    /// through `a`, `b`, `c` at `i * step` elements from their bases (a step of 0 shares an
    /// operand over the batch). An error says why cuBLAS cannot express it (no unit
    /// stride in an operand, sizes beyond its ints, or inconsistent sizes).
    pub fn plan(
        a: MatrixLayout,
        b: MatrixLayout,
        c: MatrixLayout,
        batch: usize,
        (a_step, b_step, c_step): (usize, usize, usize),
    ) -> Result<Self, String> {
        let (m, k, n) = (a.rows, a.cols, b.cols);
        if b.rows != k || c.rows != m || c.cols != n {
            return Err(format!(
                "[{}, {}] x [{}, {}] -> [{}, {}] is not a product",
                a.rows, a.cols, b.rows, b.cols, c.rows, c.cols
            ));
        }
        let operand = |what: &str, x: MatrixLayout| {
            x.column_major().ok_or_else(|| {
                format!(
                    "operand {what} has strides ({}, {}): cuBLAS needs one of them to be 1",
                    x.row_stride, x.col_stride
                )
            })
        };
        let (c_transposed, ldc) = operand("c", c)?;
        let (a_transposed, lda) = operand("a", a)?;
        let (b_transposed, ldb) = operand("b", b)?;
        // Output stored row-major (memory holds `cᵀ` column-major): cuBLAS computes
        // `cᵀ = bᵀ·aᵀ`, so its `A` is `b`, which must be read as `bᵀ`: the memory holds
        // `bᵀ` (op N) when `b` is stored row-major, else `b` (op T). Likewise for `a`.
        // Output stored column-major: cuBLAS computes `c = a·b` directly, and an operand
        // needs op T exactly when its memory holds its transpose.
        let (swapped, transa, transb, cm, cn, lda, ldb, stride_a, stride_b) = if c_transposed {
            (true, !b_transposed, !a_transposed, n, m, ldb, lda, b_step, a_step)
        } else {
            (false, a_transposed, b_transposed, m, n, lda, ldb, a_step, b_step)
        };
        Ok(Self {
            swapped,
            transa,
            transb,
            m: int("m", cm)?,
            n: int("n", cn)?,
            k: int("k", k)?,
            lda: int("lda", lda)?,
            ldb: int("ldb", ldb)?,
            ldc: int("ldc", ldc)?,
            stride_a: long("stride_a", stride_a)?,
            stride_b: long("stride_b", stride_b)?,
            stride_c: long("stride_c", c_step)?,
            batch: int("batch", batch)?,
        })
    }

    /// Whether the product has no multiply-add (an empty dimension or batch): cuBLAS is not
    /// called; with `k == 0` the output is zero-filled by the caller instead.
    pub fn is_empty(&self) -> bool {
        self.m == 0 || self.n == 0 || self.k == 0 || self.batch == 0
    }

    /// Evaluates the product on the host exactly as cuBLAS would read these arguments
    /// (column-major, op flags, leading dimensions, batch strides), adding `alpha · AB` to
    /// `beta · C`: the reference the argument mapping is unit-tested against.
    #[doc(hidden)]
    pub fn reference(&self, a: &[f64], b: &[f64], c: &mut [f64], alpha: f64, beta: f64) {
        let (first, second) = if self.swapped { (b, a) } else { (a, b) };
        let at = |x: &[f64], trans: bool, ld: i32, stride: i64, batch: usize, r: usize, col: usize| {
            let (r, col) = if trans { (col, r) } else { (r, col) };
            x[batch * stride as usize + r + col * ld as usize]
        };
        for i in 0..self.batch as usize {
            for row in 0..self.m as usize {
                for col in 0..self.n as usize {
                    let mut sum = 0.0;
                    for l in 0..self.k as usize {
                        sum += at(first, self.transa, self.lda, self.stride_a, i, row, l)
                            * at(second, self.transb, self.ldb, self.stride_b, i, l, col);
                    }
                    let slot = &mut c[i * self.stride_c as usize + row + col * self.ldc as usize];
                    // As cuBLAS: with beta == 0, C is written, never read (it may hold NaN).
                    *slot = if beta == 0.0 { alpha * sum } else { alpha * sum + beta * *slot };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Row-major `a (m x k) · b (k x n)` read through layouts, the plain way.
    #[allow(clippy::too_many_arguments)]
    fn naive(
        a: &[f64],
        al: MatrixLayout,
        b: &[f64],
        bl: MatrixLayout,
        c: &mut [f64],
        cl: MatrixLayout,
        steps: (usize, usize, usize),
        batch: usize,
    ) {
        for i in 0..batch {
            for r in 0..al.rows {
                for col in 0..bl.cols {
                    let mut sum = 0.0;
                    for l in 0..al.cols {
                        sum += a[i * steps.0 + r * al.row_stride + l * al.col_stride]
                            * b[i * steps.1 + l * bl.row_stride + col * bl.col_stride];
                    }
                    c[i * steps.2 + r * cl.row_stride + col * cl.col_stride] = sum;
                }
            }
        }
    }

    fn values(n: usize, seed: u64) -> Vec<f64> {
        (0..n).map(|i| ((i as u64 * 2_654_435_761 + seed * 97) % 1000) as f64 / 100.0 - 5.0).collect()
    }

    /// Checks that cuBLAS's reading of the planned arguments computes the same product.
    fn agree(
        al: MatrixLayout,
        bl: MatrixLayout,
        cl: MatrixLayout,
        batch: usize,
        steps: (usize, usize, usize),
        lens: (usize, usize, usize),
    ) {
        let (a, b) = (values(lens.0, 1), values(lens.1, 2));
        let mut want = vec![0.0; lens.2];
        naive(&a, al, &b, bl, &mut want, cl, steps, batch);
        let gemm = Gemm::plan(al, bl, cl, batch, steps).unwrap();
        let mut got = vec![0.0; lens.2];
        gemm.reference(&a, &b, &mut got, 1.0, 0.0);
        assert_eq!(got, want, "{gemm:?}");
    }

    #[test]
    fn row_major_products_with_every_transpose_are_the_swapped_column_major_ones() {
        for (m, k, n) in [(1, 1, 1), (3, 5, 7), (7, 1, 2), (1, 4, 1), (2, 3, 1)] {
            for ta in [false, true] {
                for tb in [false, true] {
                    for batch in [1, 3] {
                        let (al, bl, cl) = (
                            MatrixLayout::row_major(m, k, ta),
                            MatrixLayout::row_major(k, n, tb),
                            MatrixLayout::row_major(m, n, false),
                        );
                        // Both batched, then `b` shared (step 0).
                        agree(al, bl, cl, batch, (m * k, k * n, m * n), (batch * m * k, batch * k * n, batch * m * n));
                        agree(al, bl, cl, batch, (m * k, 0, m * n), (batch * m * k, k * n, batch * m * n));
                        let g = Gemm::plan(al, bl, cl, batch, (m * k, k * n, m * n)).unwrap();
                        // The row-major output makes cuBLAS compute cᵀ = bᵀ·aᵀ.
                        assert!(g.swapped);
                        assert_eq!((g.m, g.n, g.k), (n as i32, m as i32, k as i32));
                        if m > 1 && k > 1 && n > 1 {
                            assert_eq!((g.transa, g.transb), (tb, ta), "op flags carry the transposes, never copies");
                            assert_eq!(
                                (g.lda, g.ldb, g.ldc),
                                (if tb { k } else { n } as i32, if ta { m } else { k } as i32, n as i32)
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_column_major_output_is_computed_directly() {
        let (m, k, n) = (3, 4, 5);
        let cl = MatrixLayout { rows: m, cols: n, row_stride: 1, col_stride: m };
        let (al, bl) = (MatrixLayout::row_major(m, k, false), MatrixLayout::row_major(k, n, true));
        let g = Gemm::plan(al, bl, cl, 2, (m * k, k * n, m * n)).unwrap();
        assert!(!g.swapped);
        assert_eq!((g.transa, g.transb, g.m, g.n, g.ldc), (true, false, 3, 5, 3));
        agree(al, bl, cl, 2, (m * k, k * n, m * n), (2 * m * k, 2 * k * n, 2 * m * n));
    }

    #[test]
    fn padded_strides_become_leading_dimensions() {
        // Rows of `a` 9 elements apart (a column block of a wider matrix).
        let al = MatrixLayout { rows: 3, cols: 4, row_stride: 9, col_stride: 1 };
        let bl = MatrixLayout { rows: 4, cols: 2, row_stride: 1, col_stride: 6 };
        let cl = MatrixLayout { rows: 3, cols: 2, row_stride: 5, col_stride: 1 };
        agree(al, bl, cl, 2, (30, 12, 15), (60, 24, 30));
    }

    #[test]
    fn strides_of_single_element_axes_are_free() {
        // A row vector with a column stride of 5 (no unit stride, but one row).
        let v = MatrixLayout { rows: 1, cols: 4, row_stride: 77, col_stride: 5 };
        assert_eq!(v.column_major(), Some((false, 5)));
        let s = MatrixLayout { rows: 1, cols: 1, row_stride: 0, col_stride: 0 };
        assert_eq!(s.column_major(), Some((true, 1)));
        agree(v, MatrixLayout::row_major(4, 3, false), MatrixLayout::row_major(1, 3, false), 1, (0, 0, 0), (20, 12, 3));
    }

    #[test]
    fn operands_without_a_unit_stride_or_too_large_are_refused() {
        let bad = MatrixLayout { rows: 2, cols: 3, row_stride: 3 * 4, col_stride: 4 };
        let e =
            Gemm::plan(bad, MatrixLayout::row_major(3, 2, false), MatrixLayout::row_major(2, 2, false), 1, (0, 0, 0));
        assert!(e.unwrap_err().contains("operand a has strides (12, 4)"));
        let huge = 1usize << 31;
        let e = Gemm::plan(
            MatrixLayout::row_major(huge, 1, false),
            MatrixLayout::row_major(1, 1, false),
            MatrixLayout::row_major(huge, 1, false),
            1,
            (0, 0, 0),
        );
        assert!(e.unwrap_err().contains("exceeds cuBLAS's 32-bit int"));
        let e = Gemm::plan(
            MatrixLayout::row_major(2, 3, false),
            MatrixLayout::row_major(2, 2, false),
            MatrixLayout::row_major(2, 2, false),
            1,
            (0, 0, 0),
        );
        assert!(e.unwrap_err().contains("is not a product"));
    }
}
