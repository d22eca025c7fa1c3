-- Argo CD health check for berth.dev/LLMDeployment (Argo CD runs it with gopher-lua: Lua 5.1).
-- Healthy: Ready, and both the reconcile (status.observedGeneration) and the health daemon
-- (each condition's observedGeneration) have seen the current generation. Progressing: a new
-- spec not reconciled or not judged yet, worlds starting, restarting, parking or waking, a
-- scale-down draining. Suspended: every engine sleeps because spec.sleep says so (as Argo CD
-- shows a stopped KServe service); asleep on a schedule is Healthy, saying when it wakes, and
-- so is asleep for idleness (spec.autoscaling: the first request wakes it). A
-- rollout under way is Progressing (Degraded once it stopped on a world that failed it).
-- Degraded: a world used up its restarts (the message carries the engine's own error) or the
-- operator refused the spec (observedGeneration is set then).
local hs = { status = "Progressing", message = "Waiting for the berth operator" }
if obj.status == nil then
  return hs
end

local function condition(kind)
  if obj.status.conditions == nil then
    return nil
  end
  for _, c in ipairs(obj.status.conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

local generation = nil
if obj.metadata ~= nil then
  generation = obj.metadata.generation
end
if generation ~= nil and (obj.status.observedGeneration == nil or obj.status.observedGeneration < generation) then
  hs.message = "Waiting for the operator to reconcile generation " .. tostring(generation)
  return hs
end

-- Conditions carry the generation they were computed for: until the health daemon has judged
-- this generation, what they say is about the previous spec.
if generation ~= nil and obj.status.conditions ~= nil then
  for _, c in ipairs(obj.status.conditions) do
    if c.observedGeneration ~= nil and c.observedGeneration < generation then
      hs.message = "Waiting for the operator to report on generation " .. tostring(generation)
      return hs
    end
  end
end

local degraded = condition("Degraded")
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = degraded.message or degraded.reason or "Degraded"
  return hs
end

-- A rollout (status.rollout, without complete while under way) is the spec not yet converged,
-- even while every world is ready (between two worlds): never Healthy until it is done.
local rollout = obj.status.rollout
if rollout ~= nil and rollout.target ~= nil and rollout.complete ~= true then
  if rollout.failed ~= nil then
    hs.status = "Degraded"
    hs.message = "rollout to " .. tostring(rollout.target) .. " stopped: " .. tostring(rollout.failed.message)
    return hs
  end
  local done = 0
  if rollout.done ~= nil then
    done = #rollout.done
  end
  hs.message = "rolling out " .. tostring(rollout.target) .. ": " .. tostring(done) .. " world(s) done"
  local progressing = condition("Progressing")
  if progressing ~= nil and progressing.status == "True" and progressing.message ~= nil then
    hs.message = hs.message .. "; " .. progressing.message
  end
  return hs
end

local sleeping = condition("Sleeping")
if sleeping ~= nil and sleeping.status == "True" and (sleeping.reason == "ScheduledSleep" or sleeping.reason == "IdleSleep") then
  -- Asleep as its schedule says, or idle (spec.autoscaling: the first request wakes it): the
  -- plan, nothing for anyone to do. The message says when it wakes.
  hs.status = "Healthy"
  hs.message = sleeping.message or "asleep on schedule"
  local upcoming = obj.status.nextTransition
  if upcoming ~= nil and upcoming.message ~= nil then
    hs.message = hs.message .. "; next: " .. upcoming.message
  end
  return hs
end
if sleeping ~= nil and sleeping.status == "True" then
  hs.status = "Suspended"
  hs.message = sleeping.message or "Sleeping"
  return hs
end

local ready = condition("Ready")
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = ready.message or "Ready"
  return hs
end

local progressing = condition("Progressing")
if progressing ~= nil and progressing.message ~= nil and progressing.message ~= "" then
  hs.message = progressing.message
elseif ready ~= nil and ready.message ~= nil then
  hs.message = ready.message
end
return hs
