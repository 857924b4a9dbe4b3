// ReplyLiveness: when a batch that got no reply by its deadline means the shard dropped the
// client (open the data plane again), and when the shard is only busy (keep the connection).
// The orders below are the ones the data plane sees; the cluster case is in
// tests/services/data_plane_test.cc (ABatchTimedOutBehindALongOneKeepsTheConnection).
#include "attention-svc/dataplane/reply_liveness.h"

#include <gtest/gtest.h>

namespace moe::attention_svc {
namespace {

TEST(ReplyLiveness, ALoneBatchWithNothingBackMeansGone) {
  ReplyLiveness live;
  const uint64_t t = live.Sent();
  EXPECT_TRUE(live.TimedOutMeansGone(t));
}

// The readiness canary queued behind a long prefill on one compute thread.
TEST(ReplyLiveness, ABatchBehindAnOlderOneStillWaitingMeansBusy) {
  ReplyLiveness live;
  const uint64_t prefill = live.Sent(), canary = live.Sent();
  EXPECT_FALSE(live.TimedOutMeansGone(canary));
  live.Finished(canary);
  // The older one gets nothing either, by its own deadline: now nothing speaks for the shard.
  EXPECT_TRUE(live.TimedOutMeansGone(prefill));
}

TEST(ReplyLiveness, AReplyAfterTheBatchLeftMeansBusy) {
  ReplyLiveness live;
  const uint64_t first = live.Sent(), second = live.Sent();
  live.Replied();  // the first one's reply, after the second left
  live.Finished(first);
  EXPECT_FALSE(live.TimedOutMeansGone(second));
}

// The shard replaced the client between two batches (another process under the node's name):
// the reply before the batch left says nothing about it.
TEST(ReplyLiveness, AReplyBeforeTheBatchLeftDoesNotCount) {
  ReplyLiveness live;
  const uint64_t first = live.Sent();
  live.Replied();
  live.Finished(first);
  const uint64_t dropped = live.Sent();
  EXPECT_TRUE(live.TimedOutMeansGone(dropped));
}

// Only older batches speak for the shard: one sent later may be dropped just the same.
TEST(ReplyLiveness, ANewerBatchStillWaitingDoesNotCount) {
  ReplyLiveness live;
  const uint64_t older = live.Sent();
  (void)live.Sent();
  EXPECT_TRUE(live.TimedOutMeansGone(older));
}

TEST(ReplyLiveness, AnOlderBatchWhoseWaiterIsDoneDoesNotCount) {
  ReplyLiveness live;
  const uint64_t older = live.Sent(), later = live.Sent();
  live.Finished(older);  // failed or dropped, no reply
  EXPECT_TRUE(live.TimedOutMeansGone(later));
}

}  // namespace
}  // namespace moe::attention_svc
