package dev.edgespec.core

import java.math.BigInteger

/**
 * The random stream the verify and sampling code consumes: one uniform double in [0, 1) per draw.
 * Python's definition (edge_spec/sampling.py, edge_spec/verify.py) takes them from
 * `np.random.default_rng(seed).random()`; [Pcg64] reproduces that stream bit for bit, and
 * [ReplayUniforms] replays a recorded one.
 */
interface UniformSource {
    fun nextDouble(): Double
}

class ReplayUniforms(private val values: DoubleArray) : UniformSource {
    var consumed = 0
        private set
    override fun nextDouble(): Double {
        check(consumed < values.size) { "uniform stream exhausted after ${values.size} draws" }
        return values[consumed++]
    }
}

/**
 * numpy's default generator: SeedSequence(seed) -> PCG64 (XSL-RR 128/64), and
 * Generator.random() = (next64 >>> 11) * 2^-53. `Pcg64(seed)` draws what `np.random.default_rng(seed)` draws.
 */
class Pcg64(seed: BigInteger) : UniformSource {
    constructor(seed: Long) : this(BigInteger.valueOf(seed))

    private var stateHi = 0L
    private var stateLo = 0L
    private var incHi = 0L
    private var incLo = 0L

    init {
        require(seed.signum() >= 0) { "seed must be >= 0 (numpy seeding rule), got $seed" }
        val words = seedSequenceState(seed, 8) // 4 uint64 = 8 uint32, little-endian pairs
        fun u64(i: Int) = (words[2 * i].toLong() and 0xffffffffL) or (words[2 * i + 1].toLong() shl 32)
        val s0 = u64(0); val s1 = u64(1); val i0 = u64(2); val i1 = u64(3)
        // pcg64_set_seed: initstate = (s0 << 64) | s1, initseq = (i0 << 64) | i1
        incHi = (i0 shl 1) or (i1 ushr 63)
        incLo = (i1 shl 1) or 1L
        stateHi = 0; stateLo = 0
        step()
        val lo = stateLo + s1
        val carry = if (java.lang.Long.compareUnsigned(lo, stateLo) < 0) 1L else 0L
        stateLo = lo; stateHi = stateHi + s0 + carry
        step()
    }

    private fun step() {
        // state = state * MULT + inc (mod 2^128)
        val mulHi = 2549297995355413924L
        val mulLo = 4865540595714422341L
        val lo = stateLo * mulLo
        val hi = unsignedMultiplyHigh(stateLo, mulLo) + stateLo * mulHi + stateHi * mulLo
        val newLo = lo + incLo
        val carry = if (java.lang.Long.compareUnsigned(newLo, lo) < 0) 1L else 0L
        stateLo = newLo
        stateHi = hi + incHi + carry
    }

    fun nextLong(): Long {
        step()
        val rot = (stateHi ushr 58).toInt()
        return java.lang.Long.rotateRight(stateHi xor stateLo, rot)
    }

    override fun nextDouble(): Double = (nextLong() ushr 11) * (1.0 / 9007199254740992.0)

    companion object {
        private fun unsignedMultiplyHigh(a: Long, b: Long): Long {
            // 64x64 -> high 64 bits, unsigned, portably (the JDK's multiplyHigh needs Android API 31+).
            val a0 = a and 0xffffffffL; val a1 = a ushr 32
            val b0 = b and 0xffffffffL; val b1 = b ushr 32
            val p00 = a0 * b0; val p01 = a0 * b1; val p10 = a1 * b0; val p11 = a1 * b1
            val mid = (p00 ushr 32) + (p01 and 0xffffffffL) + (p10 and 0xffffffffL)
            return p11 + (p01 ushr 32) + (p10 ushr 32) + (mid ushr 32)
        }

        private const val INIT_A = 0x43b0d7e5
        private const val MULT_A = 0x931e8875.toInt()
        private const val INIT_B = 0x8b51f9dd.toInt()
        private const val MULT_B = 0x58f38ded
        private const val MIX_MULT_L = 0xca01f9dd.toInt()
        private const val MIX_MULT_R = 0x4973f715
        private const val POOL_SIZE = 4

        /** numpy.random.SeedSequence(seed).generate_state(nWords, uint32). */
        fun seedSequenceState(seed: BigInteger, nWords: Int): IntArray {
            val entropy = ArrayList<Int>()
            var v = seed
            val mask = BigInteger.valueOf(0xffffffffL)
            if (v.signum() == 0) entropy.add(0)
            while (v.signum() > 0) { entropy.add(v.and(mask).toLong().toInt()); v = v.shiftRight(32) }
            val pool = IntArray(POOL_SIZE)
            var hashConst = INIT_A
            fun hashmix(value0: Int): Int {
                var value = value0 xor hashConst
                hashConst *= MULT_A
                value *= hashConst
                value = value xor (value ushr 16)
                return value
            }
            fun mix(x: Int, y: Int): Int {
                var r = MIX_MULT_L * x - MIX_MULT_R * y
                r = r xor (r ushr 16)
                return r
            }
            for (i in 0 until POOL_SIZE) pool[i] = hashmix(if (i < entropy.size) entropy[i] else 0)
            for (src in 0 until POOL_SIZE) for (dst in 0 until POOL_SIZE) if (src != dst) pool[dst] = mix(pool[dst], hashmix(pool[src]))
            for (src in POOL_SIZE until entropy.size) for (dst in 0 until POOL_SIZE) pool[dst] = mix(pool[dst], hashmix(entropy[src]))
            val out = IntArray(nWords)
            var hc = INIT_B
            for (i in 0 until nWords) {
                var d = pool[i % POOL_SIZE]
                d = d xor hc
                hc *= MULT_B
                d *= hc
                d = d xor (d ushr 16)
                out[i] = d
            }
            return out
        }
    }
}
